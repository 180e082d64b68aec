"""A multi-host job on loopback, run as docs/fault-tolerance.md ("Many hosts") says: a lighthouse and each group
under torchrun as separate commands sharing one run directory; torchrun restarts a group that
lost a worker, the lighthouse writes the job's summary.json once it ends (``role=summary`` writes
the same from the directory afterwards). Faults between hosts: tests/experiments/test_multihost_netns.py."""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.exits import JOB_ENDED_EXIT_CODE
from diloco.launch.local_cluster import free_port
from diloco.worker.stopped_guard import children_of
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def workers_of(agent: subprocess.Popen) -> list[int]:
    """The pids of the workers torchrun's agent runs now (not the leader's stopped guard)."""
    return sorted(pid for pid in children_of(agent.pid) if "role=group" in Path(f"/proc/{pid}/cmdline").read_text())


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.2)


def test_groups_under_torchrun_come_back_from_a_killed_and_a_stopped_worker_and_end_with_one_summary(tmp_path):
    """Two groups of two workers under ``torchrun --max-restarts``: a worker of group 0 SIGKILLed,
    then a worker of group 1 SIGSTOPped for good; torchrun restarts each group (the stopped worker
    killed by the group's guard after ``cluster.timeouts.stopped``), both heal from the other, and
    the job ends ok with one digest."""
    token = secrets.token_hex(16)
    (tmp_path / "run42.token").write_text(token + "\n")  # outside the run directory, as the docs say
    common = ["name=run42", "cluster.groups=2", "cluster.workers_per_group=2", "cluster.device=cpu", "logger=none"]
    # 200 steps: the stop comes once group 0 healed (step 100 on two busy cores), and group 1 heals from a
    # peer in mid-run or, on a fast machine, from a finished group 0 in a closing round.
    common += ["trainer.max_steps=200", "algo.sync_every=20", "trainer.eval_every=0", "trainer.eval_batches=2"]
    common += ["cluster.timeouts.stopped=3", f"cluster.lighthouse.port={free_port('127.0.0.1')}"]
    common += [f"cluster.lighthouse.token_file={tmp_path / 'run42.token'}"]
    run_dir = tmp_path / "run"
    lighthouse = subprocess.Popen(
        [sys.executable, "run.py", "role=lighthouse", *common, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # Two "hosts" share this machine's cores: one thread each, or their spinning threads take turns
    # (each group's 10 steps took 3-8 s instead of 0.5).
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"group{g}.log" for g in range(2)]
    groups = [
        subprocess.Popen(
            [
                *torchrun,
                "--max-restarts",
                "2",
                "run.py",
                "role=group",
                f"group.id={g}",
                *common,
                f"hydra.run.dir={run_dir}",
            ],
            cwd=REPO,
            env=one_thread,
            stdout=logs[g].open("w"),
            stderr=subprocess.STDOUT,
        )
        for g in range(2)
    ]
    commits = [run_dir / "commits" / f"group{g}.jsonl" for g in range(2)]
    try:
        for g, fault in [(0, signal.SIGKILL), (1, signal.SIGSTOP)]:
            wait_for(lambda: all(c.exists() and c.read_text().count("\n") >= 2 for c in commits), 120, "rounds")
            os.kill(workers_of(groups[g])[-1], fault)
            healed = functools.partial(lambda log: "healed" in log.read_text(), logs[g])
            wait_for(healed, 120, f"group {g} healing after its {fault.name}")
        outputs = [p.communicate(timeout=300)[0] or "" for p in [*groups, lighthouse]]
    finally:
        for process in [*groups, lighthouse]:
            if process.poll() is None:
                process.kill()
    outputs[:2] = [log.read_text() for log in logs]
    for process, output in zip([*groups, lighthouse], outputs):
        assert process.returncode == 0, output[-3000:]
    assert "stopped guard: worker pid" in outputs[1], outputs[1][-3000:]
    # What each terminal says: the group's progress and its done line, once (its leader's), the
    # killed worker's peer in one line, no traceback; the lighthouse a line per quorum, no JSON.
    for g, output in enumerate(outputs[:2]):
        assert output.count(f"done: group {g} holds the job's final model (round ") == 1, output[-3000:]
        assert "step 200/200 [" in output and output.count("TFLOP/s per device") <= 3, output[-3000:]
    assert "error: group 0 rank " in outputs[0] and "a worker of its group is gone" in outputs[0], outputs[0][-3000:]
    assert "Traceback" not in outputs[0], outputs[0][-3000:]
    assert "quorum formed: {" not in outputs[-1] and " for round 1: group0, group1 (lane " in outputs[-1], outputs[-1]
    assert "faults: 2 restarts, " in outputs[-1], outputs[-1]  # torchrun's, from the commit logs
    assert "job 'run42' ended at round" in outputs[-1] and "done: eval loss" in outputs[-1], outputs[-1]
    by_lighthouse = json.loads((run_dir / "summary.json").read_text())
    assert by_lighthouse["ok"] and by_lighthouse["groups_missing_results"] == [], by_lighthouse["failure"]
    assert by_lighthouse["recoveries"] >= 2, by_lighthouse
    (run_dir / "summary.json").unlink()
    summarized = subprocess.run(
        [sys.executable, "run.py", "role=summary", *common, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summarized.returncode == 0, summarized.stdout + summarized.stderr
    assert "done: eval loss" in summarized.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and summary["groups_missing_results"] == [], summary["failure"]
    assert len({r["digest"] for r in summary["per_group"]}) == 1 and summary["final_round"] >= 4
    assert sorted(summary["model_saved_by_groups"]) == [0, 1] and (run_dir / "model.pt").exists()
    assert {k: v for k, v in summary.items() if k != "wall_seconds"} == {
        k: v for k, v in by_lighthouse.items() if k != "wall_seconds"
    }
    assert "lighthouse: run42" in (run_dir / "status.html").read_text(), "role=lighthouse leaves its page behind"
    holding = [str(p) for p in run_dir.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert not holding and token not in "".join(outputs), holding  # the token stays out of every file
    # A group torchrun restarts after the job's end (one that had died before it, say) is told so at
    # once (exit 3), not after timeouts.
    (run_dir / "results" / "group1.json").unlink()
    late = subprocess.run(
        [sys.executable, "run.py", "role=group", "group.id=1", *common, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env={
            **one_thread,
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert late.returncode == JOB_ENDED_EXIT_CODE and "came back too late" in late.stderr, late.stderr


def test_role_summary_of_a_directory_without_results_says_where_to_point_it(tmp_path):
    done = subprocess.run(
        [sys.executable, "run.py", "role=summary", "logger=none", f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert f"error: hydra.run.dir={tmp_path}: no group wrote a result here" in done.stderr


def test_a_group_refused_under_torchrun_is_not_started_again(tmp_path):
    """A cause the next start would meet again ends the group once (exit 5 of its workers; torchrun
    stopped, not restarting it), with the line kept for the orchestrator in RUN_DIR/refused/: a port
    no lighthouse listens on (checked before the model is built), and a lighthouse that refuses the
    group (a group count other than its job's)."""
    (tmp_path / "token").write_text(secrets.token_hex(16) + "\n")
    port = free_port("127.0.0.1")
    common = ["name=run42", "cluster.workers_per_group=2", "logger=none", f"cluster.lighthouse.port={port}"]
    common += [f"cluster.lighthouse.token_file={tmp_path / 'token'}", "cluster.timeouts.connect=3"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

    def group(run_dir: Path, groups: int) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        done = subprocess.run(
            [*torchrun, "--max-restarts", "5", "run.py", "role=group", "group.id=0", f"cluster.groups={groups}"]
            + [*common, f"hydra.run.dir={run_dir}"],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=180,
        )
        return done, time.monotonic() - start

    nowhere, took = group(tmp_path / "nowhere", 2)
    said = (tmp_path / "nowhere" / "refused" / "group0.txt").read_text().strip()
    assert said.startswith(f"error: cannot reach the lighthouse at 127.0.0.1:{port} within cluster.timeouts.connect=3s")
    assert nowhere.returncode != 0 and "will restart worker group" not in nowhere.stderr, nowhere.stderr[-3000:]
    assert took < 60, f"one wait of 3 s and a stop, not 5 restarts: {took:.0f} s"

    run_dir = tmp_path / "run"
    lighthouse = subprocess.Popen(
        [sys.executable, "run.py", "role=lighthouse", "cluster.groups=2", *common, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        refused, _ = group(run_dir, 3)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    said = (run_dir / "refused" / "group0.txt").read_text().strip()
    assert (
        said.startswith("error: the lighthouse refused group group0:")
        and "this lighthouse's job has 2, this group 3" in said
    )
    assert refused.returncode != 0 and "will restart worker group" not in refused.stderr, refused.stderr[-3000:]
