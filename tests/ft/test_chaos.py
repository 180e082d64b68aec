"""Chaos and supervision: the whole local job under planned faults, and a clean shutdown."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diloco.launcher import JobFailed
from diloco.run_local import launch
from diloco.summary import read_jsonl
from diloco.worker import RunPaths
from tests.conftest import REPO, compose_job

pytestmark = pytest.mark.slow

CHAOS = [
    "logger=none",
    "cluster.groups=3",
    "cluster.workers_per_group=1",
    "cluster.device=cpu",
    "algo.sync_every=10",
    "trainer.max_steps=2000",
    "trainer.seq_len=64",
    "trainer.batch_size=4",
    "trainer.eval_every=0",
    "trainer.log_every=20",
    "cluster.timeouts.collective=5",
    "cluster.timeouts.heartbeat=2",
    "faults=chaos",
    "faults.seed=3",
    "faults.start_after=8",
    "faults.stop_after=25",
    "faults.kill_every=8",
    "faults.hang_every=60",
    "faults.hang_seconds=4",
    "faults.nan_every=60",
    "faults.break_lane_every=0",
    "faults.restart_lighthouse_every=0",
]


def test_chaos_run_completes_and_every_killed_group_recovers(tmp_path):
    job = compose_job(CHAOS)
    summary = launch(job, tmp_path)
    events = read_jsonl(tmp_path / "events.jsonl")
    kinds = [e["kind"] for e in events]
    kills = kinds.count("kill")
    assert kills >= 3 and kinds.count("hang") == 1 and kinds.count("nan") == 1, kinds
    assert "crash" not in kinds, events
    assert kinds.count("restart") == kills
    assert summary["time_to_heal_s"]["count"] == kills, "every restarted group must commit again"
    assert summary["recoveries"] >= kills
    assert summary["groups_missing_results"] == []
    assert len({r["digest"] for r in summary["per_group"]}) == 1, "global state differs at the end"
    assert len({r["rounds"] for r in summary["per_group"]}) == 1
    losses = [
        r["train/loss"]
        for g in range(3)
        for r in read_jsonl(RunPaths(tmp_path).metrics(g))
        if r.get("train/loss") is not None
    ]
    assert all(math.isfinite(x) for x in losses)
    assert summary["final_eval_loss"] < math.log(256) - 2.0
    nan_rounds = [r for g in range(3) for r in read_jsonl(RunPaths(tmp_path).commits(g)) if not r["committed"]]
    assert nan_rounds, "the NaN group's round must not be committed"


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_launcher_leaves_no_process_behind(tmp_path, signum):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "run.py",
            "logger=none",
            "trainer.max_steps=100000",
            "algo.sync_every=10",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "commits" / "group0.jsonl").exists():
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.stdout.read()
            time.sleep(0.5)
        assert len(_processes_mentioning(str(run_dir))) >= 5  # lighthouse + 2 groups x 2 workers
        launcher.send_signal(signum)
        output, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0, "an interrupted job must not report success"
    assert "interrupted" in output
    time.sleep(1)
    assert _processes_mentioning(str(run_dir)) == [], "orphans left behind"


def test_a_group_that_keeps_crashing_fails_the_job_with_its_last_lines(tmp_path):
    """The data vanishes after the launcher's checks: every start of every group crashes."""
    data = tmp_path / "data.txt"
    data.write_text("some text " * 20000)
    job = compose_job(
        ["logger=none", "cluster.groups=2", "cluster.workers_per_group=1", "cluster.max_restarts=1"]
        + ["cluster.restart_backoff=0.2", "algo.sync_every=10", "trainer.max_steps=100000"]
        + ["data=text", f"data.path={data}"]
    )
    threading.Timer(1.0, data.unlink).start()
    with pytest.raises(JobFailed, match=r"failed 2 times \(cluster\.max_restarts=1\)") as failure:
        launch(job, tmp_path / "run")
    assert "no such file or folder" in str(failure.value)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["kind"] for e in events if e["group"] == 0].count("crash") >= 1
