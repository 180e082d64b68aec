"""The supervisor's end-of-job rules, on a LocalCluster of real, short-lived stand-in processes."""

from __future__ import annotations

import signal

from diloco.exits import JOB_ENDED_EXIT_CODE
from diloco.launch.lighthouse_watch import LighthouseWatch
from diloco.launch.local_cluster import crash_report, last_exception, wait_until
from diloco.stopped_watch import process_state
from diloco.train.logger import read_jsonl
from tests.stand_ins import exited, running, supervise


class FakeClock:
    """A clock that stands still until the test sets ``now``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_group_refused_because_the_job_ended_is_left_behind_and_nothing_restarts(tmp_path):
    """A group killed right after the end comes back too late: the lighthouse refuses it
    (JOB_ENDED_EXIT_CODE). That is no crash to retry, and it tells the supervisor the job is over."""
    supervisor = supervise(tmp_path, {0: running(), 1: exited(JOB_ENDED_EXIT_CODE), 2: running()})
    try:
        supervisor.check(now=1.0)
        assert supervisor.job_over and not supervisor.cluster.started
        supervisor.check(now=2.0)  # group 1 is gone now: still not restarted
        assert not supervisor.cluster.started and 1 not in supervisor.cluster.groups
        events = read_jsonl(supervisor.cluster.paths.events)
        assert [(e["kind"], e["group"]) for e in events] == [("left_behind", 1)], events
        assert not supervisor.done()  # groups 0 and 2 are still finishing
    finally:
        supervisor.cluster.stop()


def test_a_crash_before_the_end_is_restarted(tmp_path):
    supervisor = supervise(tmp_path, {0: running(), 1: exited(1), 2: running()})
    try:
        supervisor.check(now=1.0)  # no backoff here: restarted at once
        assert not supervisor.job_over and supervisor.cluster.started == [1]
        events = read_jsonl(supervisor.cluster.paths.events)
        assert [e["kind"] for e in events] == ["crash", "plan", "restart"]
        recovery = events[1]
        assert recovery["replacement"] == "fork" and recovery["choice"] in ("wait", "go_on"), recovery
        assert set(recovery["predicted"]) == {"wait", "go_on"} and not recovery["lighthouse_told"], recovery
    finally:
        supervisor.cluster.stop()


def test_a_lighthouse_that_exited_0_ended_the_job_and_a_group_killed_then_is_not_restarted(tmp_path):
    supervisor = supervise(tmp_path, {0: running(), 2: running()}, lighthouse=exited(0))  # group 1 was killed
    try:
        supervisor.check(now=1.0)
        assert supervisor.job_over and not supervisor.cluster.started
    finally:
        supervisor.cluster.stop()


def test_a_lighthouse_silent_past_its_limit_is_killed_and_restarted_and_one_that_answers_is_not(tmp_path):
    """A hung lighthouse is alive to poll(): only its silence on /alive tells (here the test says
    what the watch heard, and moves the watch's clock; its own thread asks a real lighthouse in test_chaos)."""
    answering, hung = running(), running()
    clock = FakeClock()
    watch = LighthouseWatch("http://127.0.0.1:9", limit_s=0.5, clock=clock)  # never started
    supervisor = supervise(tmp_path, {g: running() for g in range(3)}, lighthouse=answering, lighthouse_watch=watch)
    try:
        watch.heard_from(answering.pid)
        for now in (1.0, 2.0):  # no question asked meanwhile (the launcher itself was stopped): no silence
            clock.now = now
            supervisor.check(now=now)
        assert supervisor.cluster.lighthouse is answering and answering.poll() is None
        supervisor.cluster.lighthouse = hung  # never answers
        watch.unanswered()
        supervisor.check(now=2.0)  # silent since now
        clock.now = 2.5
        supervisor.check(now=2.5)  # silent for the limit, not past it
        assert hung.poll() is None and not supervisor.cluster.started
        clock.now = 3.0
        supervisor.check(now=3.0)
        assert hung.poll() == -signal.SIGKILL and supervisor.cluster.started == ["lighthouse"]
        events = read_jsonl(supervisor.cluster.paths.events)
        assert [e["kind"] for e in events] == ["lighthouse_hung", "lighthouse_crash", "lighthouse_restart"], events
        assert events[0]["silent_s"] == 1.0, "silent from the first question unanswered"
    finally:
        answering.kill()
        supervisor.cluster.stop()


def test_a_group_with_a_worker_stopped_past_the_limit_is_killed_and_restarted_unless_the_plan_stopped_it(tmp_path):
    """A stopped worker is alive to poll() and, when its whole group is stopped, nothing in the
    group ever times out: only its state in /proc tells. Group 1 is stopped by someone else,
    group 2 by the fault plan (which resumes it)."""
    stopped, planned = running(), running()
    supervisor = supervise(tmp_path, {0: running(), 1: stopped, 2: planned}, stopped_limit_s=2.0, planned_stops=(2,))
    try:
        for process in (stopped, planned):
            process.send_signal(signal.SIGSTOP)
        wait_until(lambda: process_state(stopped.pid) == "T" == process_state(planned.pid), 10, "the stops")
        for now in (1.0, 3.0):  # seen stopped from 1.0: for 2 s at 3.0, not past the limit
            supervisor.check(now=now)
        assert not supervisor.cluster.started and stopped.poll() is None
        supervisor.check(now=3.5)
        assert stopped.poll() == -signal.SIGKILL and supervisor.cluster.started == [1]
        assert planned.poll() is None, "the plan's stop is the plan's to end"
        events = read_jsonl(supervisor.cluster.paths.events)
        assert [e["kind"] for e in events] == ["hung", "plan", "restart"], events
        assert (events[0]["group"], events[0]["rank"], events[0]["stopped_s"]) == (1, 0, 2.5)
        assert supervisor.crashes[1] == 1, (
            "a failure in a row, like a crash: a group stopped at every start fails the job"
        )
    finally:
        planned.send_signal(signal.SIGCONT)
        supervisor.cluster.stop()


def test_a_crash_report_names_the_exception_of_the_last_traceback_first(tmp_path):
    """The summary keeps a failure's first line: it must say what the process died of."""
    log = tmp_path / "group0_rank0.log"
    log.write_text(
        'step 10/100\nTraceback (most recent call last):\n  File "a.py", line 1, in <module>\n'
        "KeyError: 'old'\n\nDuring handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "b.py", line 2, in load\n    raise DataError(msg)\n'
        "diloco.train.data.DataError: data state has n_windows=5 but this group has n_windows=4\n"
    )
    assert (
        last_exception(log) == "diloco.train.data.DataError: data state has n_windows=5 but this group has n_windows=4"
    )
    report = crash_report(log)
    assert report.splitlines()[0] == f"last error: {last_exception(log)}; last lines of {log}:"
    log.write_text("step 10/100\nstep 20/100\n")  # killed by a signal: no traceback, nothing guessed
    assert last_exception(log) is None and crash_report(log).startswith("last lines of")
    assert last_exception(tmp_path / "missing.log") is None
