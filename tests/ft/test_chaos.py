"""Chaos and supervision: the whole local job under planned faults, and a clean shutdown."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from diloco.launcher import launch
from diloco.local_cluster import JobFailed, serving_pid, wait_until
from diloco.logger import read_jsonl
from diloco.run_paths import RunPaths
from diloco.worker import preflight
from tests.conftest import REPO, compose_job, process_exited

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


STREAMING_CHAOS = [
    "logger=none",
    "cluster.groups=3",
    "cluster.workers_per_group=2",
    "cluster.device=cpu",
    "algo=streaming",
    "algo.sync_every=10",
    "algo.fragments=2",
    "algo.delay=1",
    "algo.quantize=fp4",
    "trainer.max_steps=400",
    "trainer.seq_len=64",
    "trainer.batch_size=4",
    "trainer.eval_every=0",
    "trainer.log_every=20",
    "cluster.timeouts.collective=5",
    "cluster.timeouts.heartbeat=2",
    "cluster.timeouts.end=30",
    "cluster.max_restarts=100",
    "cluster.restart_backoff=0.2",
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
        started = process_exited(launcher, launcher.stdout.read)
        wait_until((run_dir / "commits" / "group0.jsonl").exists, 120, "the job to start", 0.5, started)
        assert len(_processes_mentioning(str(run_dir))) >= 5  # lighthouse + 2 groups x 2 workers
        launcher.send_signal(signum)
        output, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0, "an interrupted job must not report success"
    assert "interrupted" in output
    wait_until(lambda: not _processes_mentioning(str(run_dir)), 10, "the stopped job's processes to end (orphans)")


def test_a_group_that_keeps_crashing_fails_the_job_with_its_last_lines(tmp_path, monkeypatch):
    """The data vanishes right after the launcher's checks: every start of every group crashes."""
    data = tmp_path / "data.txt"
    data.write_text("some text " * 20000)
    job = compose_job(
        ["logger=none", "cluster.groups=2", "cluster.workers_per_group=1", "cluster.max_restarts=1"]
        + ["cluster.restart_backoff=0.2", "algo.sync_every=10", "trainer.max_steps=100000"]
        + ["data=text", f"data.path={data}"]
    )

    def check_then_delete(job):
        found = preflight(job)
        data.unlink()
        return found

    monkeypatch.setattr("diloco.launcher.preflight", check_then_delete)
    with pytest.raises(JobFailed, match=r"failed 2 times \(cluster\.max_restarts=1\)") as failure:
        launch(job, tmp_path / "run")
    assert "no such file or folder" in str(failure.value)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["kind"] for e in events if e["group"] == 0].count("crash") >= 1


def _job_processes(run_dir: Path, lighthouse_url: str) -> dict[str, list[int]]:
    """The job's processes by role: the lighthouse (forked or exec'd: the pid its /status names),
    the fork server, and the workers it forked."""
    lighthouse = serving_pid(lighthouse_url)
    roles: dict[str, list[int]] = {"lighthouse": [], "forkserver": [], "worker": []}
    pids = _processes_mentioning(str(run_dir))
    servers = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pid == lighthouse:
            roles["lighthouse"].append(pid)
        elif "diloco.forkserver" in cmdline:
            servers.add(pid)
    for pid in servers - {lighthouse}:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        roles["worker" if parent in servers else "forkserver"].append(pid)
    return roles


def _trained_to_end(run_dir: Path) -> bool:
    """Some group logged its last inner step (read from the metrics files, so a lighthouse outage cannot hide it)."""
    max_steps = int(next(o for o in STREAMING_CHAOS if o.startswith("trainer.max_steps=")).split("=")[1])
    return any(r.get("step", 0) >= max_steps for path in RunPaths(run_dir).all_metrics() for r in read_jsonl(path))


def _job_ended(status_url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(status_url, timeout=1.0) as r:
            return json.loads(r.read()).get("ended") is not None
    except (OSError, ValueError):
        return False


def test_random_kills_and_hangs_of_any_process_end_with_one_trained_model_and_exit_0(tmp_path):
    """Not a planned fault plan: SIGKILL of any process of a running job (the lighthouse, the
    fork server, any worker of 3 groups x 2 workers) and SIGSTOP of random workers, at random
    times, from outside the launcher, on streaming DiLoCo, until a group has trained to the end.
    The job must still end with one trained model and exit 0.

    Faults stop there because of a known gap (issue 9): a group killed in the second after it
    reported itself finished can be counted in the job's end, and if it is the group named to
    save model.pt, no model is saved; the job then fails, honestly but needlessly."""
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "run.py", *STREAMING_CHAOS, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(launcher.stdout), daemon=True)
    reader.start()
    rng = random.Random(7)
    done: list[str] = []
    try:
        printed = process_exited(launcher, lambda: "".join(output))
        wait_until(
            lambda: any("status page" in line for line in output), 120, "the status page's address", gone=printed
        )
        first_line = next(line for line in output if "status page" in line)
        lighthouse_url = re.search(r"(http://\S+?)/?$", first_line.strip()).group(1)
        status_url = lighthouse_url + "/status"
        time.sleep(8)  # let every group start and commit
        action = "kill lighthouse"  # the first fault hits the lighthouse, the rest are drawn
        while launcher.poll() is None and not _job_ended(status_url) and not _trained_to_end(run_dir):
            roles = _job_processes(run_dir, lighthouse_url)
            targets = {"kill lighthouse": roles["lighthouse"], "kill forkserver": roles["forkserver"]}
            targets |= {"kill worker": roles["worker"], "stop worker": roles["worker"]}
            if targets[action] and not _job_ended(status_url):
                pid = rng.choice(targets[action])
                done.append(action)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP if action == "stop worker" else signal.SIGKILL)
                if action == "stop worker":
                    threading.Timer(rng.uniform(1.0, 8.0), _resume, args=(pid,)).start()
            time.sleep(rng.uniform(2.0, 5.0))
            action = rng.choices(list(targets), weights=[1, 1, 5, 3])[0]
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reader.join(5)
    log = "".join(output)
    assert launcher.returncode == 0, log
    assert done.count("kill lighthouse") >= 1 and done.count("kill worker") >= 3 and "stop worker" in done, done
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and summary["groups_missing_results"] == [], summary["failure"]
    assert len({r["digest"] for r in summary["per_group"]}) == 1 and summary["final_round"] > 0
    assert summary["lighthouse_restarts"] >= 1 and summary["final_eval_loss"] < math.log(256) - 2.0
    wait_until(lambda: not _processes_mentioning(str(run_dir)), 10, "the ended job's processes to end")


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
