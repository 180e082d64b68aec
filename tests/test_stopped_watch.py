"""Stopped workers: how long each has been stopped (``diloco.stopped_watch``), and the guard that
kills one stopped for good under torchrun, so its agent restarts the group (``stopped_guard``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from diloco.stopped_watch import StoppedWatch, process_state
from diloco.worker.stopped_guard import children_of, guard


def test_a_stopped_watch_counts_only_an_unbroken_job_control_stop():
    states = {1: "T", 2: "S"}
    watch = StoppedWatch(state=states.get)
    assert watch.stopped_for([1, 2], now=10.0) == (1, 0.0)
    assert watch.stopped_for([1, 2], now=12.0) == (1, 2.0)
    states[1] = "R"  # resumed once: the count starts again at the next stop
    assert watch.stopped_for([1, 2], now=13.0) is None
    states[1] = states[2] = "T"
    watch.stopped_for([1, 2], now=14.0)
    states[1] = "t"  # a debugger's tracing stop is not a hang
    assert watch.stopped_for([1, 2], now=20.0) == (2, 6.0)
    watch.forget([2])
    assert watch.stopped_for([2, 3], now=21.0) == (2, 0.0), (
        "a forgotten pid starts from zero; a gone one is not stopped"
    )


def test_the_guard_kills_a_worker_stopped_past_the_limit_and_leaves_with_its_leader():
    """Real processes: the test is the "agent" whose children are watched."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert worker.pid in children_of(os.getpid())
        assert guard(os.getpid(), leader=1, stopped_limit_s=0.2, parent=lambda: 2) is None, "no leader: no guard"
        worker.send_signal(signal.SIGSTOP)
        polls = iter(range(1000))  # a bound: a guard that never kills ends the test, not hangs it
        watched = guard(os.getpid(), 1, 0.2, poll_s=0.05, parent=lambda: 1 if next(polls) < 1000 else 2)
        assert watched == worker.pid and worker.wait(timeout=10) == -signal.SIGKILL
    finally:
        worker.kill()
        worker.wait()
    assert process_state(worker.pid) is None
