"""The hang that lands while a new lane forms costs the others a heartbeat timeout: real processes, real lighthouse.

Three group processes (``lane_hang_worker.py``: the real manager, client, lane watch and Gloo
lanes, no training) fail round 2 on purpose, so round 3 forms new lanes; group2 SIGSTOPs
itself just before it joins that rendezvous. The survivors' rendezvous is given up when the
lighthouse drops group2 for missed heartbeats, not at ``cluster.timeouts.connect`` (30 s), and
they go on without it; resumed, group2 ends its round without committing it.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.config.cluster import LighthouseConfig, QuorumRules
from diloco.ft.lighthouse import Lighthouse
from tests.conftest import REPO
from tests.ft.lane_hang_worker import CONNECT_S, FAILED_ON_PURPOSE, JOB, SIGNATURE

pytestmark = pytest.mark.slow

TOKEN = "lane-hang-token"
HEARTBEAT_S = 2.0
# The bound kept is heartbeat timeout + 1 s; the rest is margin for a loaded two-core machine
# (still far below the 30 s connect timeout that bounded the wait before).
STALL_BOUND_S = HEARTBEAT_S + 1.0 + 4.0
GUARD_S = 120.0  # hang guard for each process, not a measurement
HUNG_ROUND = FAILED_ON_PURPOSE + 1
ROUNDS = HUNG_ROUND + 3


def records(path: Path) -> dict[int, dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["round"]: r for r in map(json.loads, lines)}


def first_line(proc: subprocess.Popen) -> str:
    """The process's first line of output, or "" if none came within the hang guard."""
    ready, _, _ = select.select([proc.stdout], [], [], GUARD_S)
    return proc.stdout.readline() if ready else ""


def test_a_group_hung_as_a_new_lane_forms_costs_the_others_a_heartbeat_timeout(tmp_path):
    rules = QuorumRules(min_groups=2, join_timeout_s=1.0, heartbeat_timeout_s=HEARTBEAT_S, expected_groups=3)
    lighthouse = Lighthouse(LighthouseConfig(port=0, store_port=0, token=TOKEN), rules, JOB, SIGNATURE)
    lighthouse.start()
    outs = {g: tmp_path / f"{g}.jsonl" for g in ("group0", "group1", "group2")}
    procs = {}
    try:
        for group, out in outs.items():
            command = [sys.executable, str(Path(__file__).with_name("lane_hang_worker.py")), lighthouse.url, TOKEN]
            command += [group, "--rounds", str(HUNG_ROUND if group == "group2" else ROUNDS), "--out", str(out)]
            command += ["--stop-forming"] if group == "group2" else []
            procs[group] = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert "stopping" in first_line(procs["group2"]), "group2 did not reach the new lane"
        for group in ("group0", "group1"):
            assert procs[group].wait(timeout=GUARD_S) == 0, f"{group} failed"
        for group in ("group0", "group1"):
            done = records(outs[group])
            hung = done[HUNG_ROUND]
            assert "participants" not in hung, f"{group} formed the lane with a stopped member: {hung}"
            print(f"{group}: rendezvous given up after {hung['lane_s']:.1f} s (heartbeat timeout {HEARTBEAT_S:g} s)")
            assert hung["lane_s"] <= STALL_BOUND_S < CONNECT_S, f"{group} waited {hung['lane_s']:.1f} s"
            after = [done[k] for k in range(HUNG_ROUND + 1, ROUNDS + 1)]
            assert all(r["participants"] == ["group0", "group1"] and r["committed"] for r in after), after
            assert all(r["sum"] == 2.0 for r in after), "a later lane mixed in a rendezvous given up"
        procs["group2"].send_signal(signal.SIGCONT)
        assert procs["group2"].wait(timeout=GUARD_S) == 0, "group2 failed after SIGCONT"
        resumed = records(outs["group2"])[HUNG_ROUND]
        assert not resumed.get("committed"), f"group2 committed the round the others gave up: {resumed}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)
        lighthouse.stop()
