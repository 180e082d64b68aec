"""A worker under torchrun dies with its agent (``lifeline.die_with_parent``): real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from diloco.stopped_watch import process_state
from tests.conftest import REPO

AGENT = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(worker.pid, flush=True)
time.sleep(60)
"""
WORKER = """
import time
from diloco import lifeline
lifeline.die_with_parent(poll_s=0.05)
print("watching", flush=True)
time.sleep(60)
"""


def test_a_worker_dies_within_a_poll_of_its_agent():
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(agent.stdout.readline())
        assert agent.stdout.readline().strip() == "watching"
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while process_state(worker) not in (None, "Z"):  # init may leave it a zombie a while
            assert time.monotonic() < deadline, "the worker outlived its agent by 10 s"
            time.sleep(0.05)
    finally:
        agent.kill()
