"""Chaos and supervision: the whole local job under planned faults, and a clean shutdown."""

from __future__ import annotations

import contextlib
import io
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
from collections.abc import Callable
from pathlib import Path

import pytest

from diloco.launch.launcher import launch
from diloco.launch.local_cluster import JobFailed, serving_pid, wait_until
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from diloco.worker.builders import preflight
from tests.conftest import REPO, compose_job, process_exited

pytestmark = pytest.mark.slow

CHAOS = [
    "logger=none",
    "cluster.groups=3",
    "cluster.workers_per_group=1",
    "cluster.device=cpu",
    "algo.sync_every=10",
    "trainer.max_steps=1600",  # long enough on a fast machine that the kill at 14 s lands and heals
    "trainer.seq_len=64",
    "trainer.batch_size=4",
    "trainer.eval_every=0",
    "trainer.log_every=20",
    "cluster.timeouts.collective=5",
    "cluster.timeouts.heartbeat=2",
    "faults=chaos",
    "faults.seed=3",
    "faults.start_after=6",
    "faults.stop_after=15",
    "faults.kill_every=4",
    "faults.hang_every=60",
    "faults.hang_seconds=4",
    "cluster.timeouts.stopped=2",  # shorter than the plan's hang: its stop is the plan's to end
    "faults.nan_every=60",
    "faults.break_lane_every=0",
    "faults.restart_lighthouse_every=0",
]

# Three one-worker groups of a short job, for the tests that act on one group beside it.
THREE_GROUPS = [
    "logger=none",
    "cluster.groups=3",
    "cluster.workers_per_group=1",
    "cluster.device=cpu",
    "algo.sync_every=10",
    "trainer.seq_len=64",
    "trainer.batch_size=4",
    "trainer.eval_every=0",
]

CHAOS_STEPS = 600
END_FAULTS = 2
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
    f"trainer.max_steps={CHAOS_STEPS}",
    "trainer.seq_len=64",
    "trainer.batch_size=4",
    "trainer.eval_every=0",
    "trainer.log_every=20",
    "cluster.timeouts.collective=5",
    "cluster.timeouts.heartbeat=2",
    "cluster.timeouts.end=30",
    "cluster.max_restarts=100",
    "cluster.restart_backoff=0.2",
    "cluster.timeouts.lighthouse=3",
]


def test_chaos_run_completes_and_every_killed_group_recovers(tmp_path):
    job = compose_job(CHAOS)
    summary = launch(job, tmp_path)
    events = read_jsonl(tmp_path / "events.jsonl")
    kinds = [e["kind"] for e in events]
    kills = kinds.count("kill")
    assert kills >= 3 and kinds.count("hang") == 1 and kinds.count("nan") == 1, kinds
    assert "crash" not in kinds and "hung" not in kinds, events
    assert kinds.count("restart") == kills
    assert summary["time_to_heal_s"]["count"] == kills, "every restarted group must commit again"
    # A group restarted before the job's first commit joins from the shared initial state (a
    # loaded machine can fire the first kill that early); every later one must heal from a peer.
    commits = [r for g in range(3) for r in read_jsonl(RunPaths(tmp_path).commits(g))]
    first_commit = min(r["time"] for r in commits if r["committed"])
    assert summary["recoveries"] >= sum(e["kind"] == "restart" and e["time"] > first_commit for e in events), events
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
    nan_rounds = [r for r in commits if not r["committed"]]
    assert nan_rounds, "the NaN group's round must not be committed"


def _beside_the_job(action: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``action`` in a daemon thread while the test's main thread runs a job; what it raised
    is kept for the main thread to report."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as error:  # noqa: BLE001  (reported by the test's main thread)
            failures.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, failures


def test_a_group_killed_after_the_end_before_its_result_leaves_the_job_ok(tmp_path):
    """A race at the job's end: every group finished and the lighthouse declared the end; one
    group is SIGKILLed while it evaluates the final model, before it writes its result. The
    lighthouse saw it finish holding the final state, every other holder saved the model, and a
    restart of it (if any) comes too late and is refused: the job is still a success, and says
    which group it lost after the end."""
    job = compose_job(
        [*THREE_GROUPS, "trainer.max_steps=60", "trainer.eval_batches=400", "cluster.restart_backoff=0.1"]
    )
    paths = RunPaths(tmp_path / "run")
    victims: list[int] = []

    def kill_a_group_after_the_end() -> None:
        log = paths.logs / "lighthouse.log"  # the lighthouse may be gone within milliseconds of the end
        wait_until(lambda: log.exists() and "the job ended at round" in log.read_text(), 120, "the job's end", 0.02)
        victim = next(g for g in range(3) if not paths.result(g).exists())
        os.kill(read_jsonl(paths.commits(victim))[-1]["pid"], signal.SIGKILL)
        assert not paths.result(victim).exists(), "the kill came after the result: lengthen the final eval"
        victims.append(victim)

    killer, failures = _beside_the_job(kill_a_group_after_the_end)
    summary = launch(job, paths.root, out=io.StringIO())
    killer.join(5)
    assert victims and not failures, failures
    assert summary["ok"], summary["failure"]
    assert summary["groups_lost_after_end"] == summary["groups_missing_results"] == victims
    assert victims[0] not in summary["model_saved_by_groups"] and len(summary["model_saved_by_groups"]) == 2
    assert len({r["digest"] for r in summary["per_group"]}) == 1 and paths.weights.exists()
    kinds = [e["kind"] for e in read_jsonl(paths.events)]
    assert kinds.count("crash") <= 1, f"only the kill itself; a group refused after the end is no crash: {kinds}"


def test_a_group_stopped_for_good_is_killed_and_restarted_and_the_job_ends_ok(tmp_path):
    """SIGSTOP of a whole group (its only worker), never resumed: nothing in it fails or times
    out, and the lighthouse only drops it. The launcher kills it once it has been stopped for
    cluster.timeouts.stopped, restarts it, and it heals from a peer (mid-run, or from the
    finished groups that wait for it at the end): one model, every group's result."""
    job = compose_job(
        [*THREE_GROUPS, "trainer.max_steps=200", "cluster.timeouts.heartbeat=2", "cluster.timeouts.stopped=2"]
    )
    paths = RunPaths(tmp_path / "run")
    stopped: list[int] = []

    def stop_group_1_for_good() -> None:
        wait_until(lambda: any(r["committed"] for r in read_jsonl(paths.commits(1))), 120, "group 1's first commit")
        stopped.append(read_jsonl(paths.commits(1))[-1]["pid"])
        os.kill(stopped[0], signal.SIGSTOP)

    stopper, failures = _beside_the_job(stop_group_1_for_good)
    summary = launch(job, paths.root, out=io.StringIO())
    stopper.join(5)
    assert stopped and not failures, failures
    assert summary["ok"], summary["failure"]
    assert summary["groups_missing_results"] == [] and len({r["digest"] for r in summary["per_group"]}) == 1
    events = [(e["kind"], e["group"]) for e in read_jsonl(paths.events)]
    assert events[events.index(("hung", 1)) :].count(("restart", 1)) == 1, events
    assert not Path(f"/proc/{stopped[0]}").exists(), "the stopped worker was left behind"
    assert summary["recoveries"] >= 1, "the restarted group heals from a peer"
    assert summary["death_to_ready_s"]["count"] == 1, "the stopped group's kill is a death its replacement follows"


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

    def check_then_delete(job, paths, warn=None):
        found = preflight(job, paths, warn)
        data.unlink()
        return found

    monkeypatch.setattr("diloco.launch.launcher.preflight", check_then_delete)
    with pytest.raises(JobFailed, match=r"failed 2 times \(cluster\.max_restarts=1\)") as failure:
        launch(job, tmp_path / "run")
    first_line = str(failure.value).splitlines()[0]  # what summary.json keeps: it names the cause
    assert "last error: diloco.train.data.DataError: " in first_line and "no such file or folder" in first_line, (
        first_line
    )
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["failure"] == first_line
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["kind"] for e in events if e["group"] == 0].count("crash") >= 1


def _job_processes(run_dir: Path, lighthouse_url: str) -> dict[str, list[int]]:
    """The job's processes by role: the lighthouse (forked or exec'd: the pid its /status names),
    the fork server, and the workers it forked. Forked processes show the server's command line,
    and a worker whose server died is the launcher's child (its subreaper), as the server is: a
    worker is told by its output, which goes to its group's log, or by its parent, a server."""
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
        elif "diloco.launch.forkserver" in cmdline:
            servers.add(pid)
    for pid in servers - {lighthouse}:
        try:
            output = os.readlink(f"/proc/{pid}/fd/1")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        logged = Path(output).parent == run_dir / "logs"
        if parent in servers or (logged and Path(output).name not in ("lighthouse.log", "forkserver.log")):
            roles["worker"].append(pid)  # a server's child just forked has no log as its output yet
        elif not logged:  # logged otherwise: a replaced lighthouse on its way out, no one's target
            roles["forkserver"].append(pid)
    return roles


def test_random_kills_and_hangs_of_any_process_end_with_one_trained_model_and_exit_0(tmp_path):
    """Not a planned fault plan: SIGKILL of any process of a running job (the lighthouse, the
    fork server, any worker of 3 groups x 2 workers), SIGSTOP of random workers for a while and
    of the lighthouse or the fork server for good, at random times, from outside the launcher, on
    streaming DiLoCo, each once two groups have committed a newer step since the last one's target
    was down, and up to two in its closing rounds or the second after its end. The job must still
    end with one trained model and exit 0; a group may only lack a result if the lighthouse saw it
    end holding the final state (killed after the end, before it wrote its result). A stopped lighthouse is
    alive, so only its silence tells: the launcher kills it after ``cluster.timeouts.lighthouse``
    and starts another on its address before the groups' collectives time out."""
    run_dir = tmp_path / "run"
    launcher, output, reader = _run_py(STREAMING_CHAOS, run_dir)
    rng = random.Random(7)
    done: list[str] = []
    stopped_lighthouses: list[int] = []
    try:
        lighthouse_url = _lighthouse_url(launcher, output)
        time.sleep(8)  # let every group start and commit
        # Every kind of fault once (workers more often) in this order at random times, then drawn ones.
        scripted = ["kill lighthouse", "kill worker", "stop forkserver", "kill worker", "stop worker"]
        scripted += ["stop lighthouse", "kill worker", "kill forkserver"]
        action = scripted[0]
        step_at_last_fault, end_faults = -1, 0
        while launcher.poll() is None:
            # Faults faster than the job recovers (a loaded machine recovers slowly) would lose its
            # state again and again and train it again and again: each fault waits until two
            # groups committed a newer step than the last one saw once its target was down, so
            # one kill leaves a holder (every holder lost is
            # test_job_goes_on_when_every_holder_of_its_newest_state_dies). Once the last step is
            # committed, up to END_FAULTS more come in the closing rounds and the second after the
            # end, as long as each leaves a group that committed it.
            committed = _groups_by_committed_step(run_dir)
            newest_step = max(committed, default=-1)
            at_end = newest_step >= CHAOS_STEPS and end_faults < min(END_FAULTS, len(committed[newest_step]) - 1)
            if step_at_last_fault >= _held_twice(committed) and not at_end:
                time.sleep(0.2)
                continue
            end_faults += newest_step >= CHAOS_STEPS
            roles = _job_processes(run_dir, lighthouse_url)
            targets = {"kill lighthouse": roles["lighthouse"], "kill forkserver": roles["forkserver"]}
            targets |= {"kill worker": roles["worker"], "stop worker": roles["worker"]}
            targets |= {"stop lighthouse": roles["lighthouse"], "stop forkserver": roles["forkserver"]}
            if targets[action]:
                pid = rng.choice(targets[action])
                done.append(action)
                if scripted:  # it was the next scripted one
                    scripted.pop(0)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP if action.startswith("stop") else signal.SIGKILL)
                if action == "stop lighthouse":
                    stopped_lighthouses.append(pid)
                if action == "stop worker":
                    threading.Timer(rng.uniform(1.0, 8.0), _resume, args=(pid,)).start()
            time.sleep(rng.uniform(1.5, 4.0))
            step_at_last_fault = _held_twice(_groups_by_committed_step(run_dir))  # what a victim committed is in
            action = scripted[0] if scripted else rng.choices(list(targets), weights=[1, 1, 5, 3, 0.5, 0.5])[0]
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reader.join(5)
    log = "".join(output)
    assert launcher.returncode == 0, log
    assert not scripted, f"the job ended before every kind of fault was tried: {done}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"], summary["failure"]
    assert set(summary["groups_missing_results"]) <= set(summary["groups_lost_after_end"]), summary
    assert len({r["digest"] for r in summary["per_group"]}) == 1 and summary["final_round"] > 0
    assert summary["lighthouse_restarts"] >= 1 and summary["final_eval_loss"] < math.log(256) - 2.0
    kinds = [e["kind"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert "lighthouse_hung" in kinds, kinds
    assert not any(Path(f"/proc/{pid}").exists() for pid in stopped_lighthouses), "a hung lighthouse was left stopped"
    wait_until(lambda: not _processes_mentioning(str(run_dir)), 10, "the ended job's processes to end")


def _run_py(args: list[str], run_dir: Path) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """``python run.py`` started in the background, its output lines collected as they come."""
    launcher = subprocess.Popen(
        [sys.executable, "run.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(launcher.stdout), daemon=True)
    reader.start()
    return launcher, output, reader


def _lighthouse_url(launcher: subprocess.Popen, output: list[str]) -> str:
    """The lighthouse address the launcher prints on its first line."""
    printed = process_exited(launcher, lambda: "".join(output))
    wait_until(lambda: any("status page" in line for line in output), 120, "the status page's address", gone=printed)
    return re.search(r"(http://\S+?)/?$", next(line for line in output if "status page" in line).strip()).group(1)


def _held_twice(committed: dict[int, set[str]]) -> int:
    """The newest inner step at least two groups committed (-1 before the first)."""
    return max((step for step, groups in committed.items() if len(groups) >= 2), default=-1)


def _groups_by_committed_step(run_dir: Path) -> dict[int, set[str]]:
    """The groups that committed a round at each inner step, so far."""
    steps: dict[int, set[str]] = {}
    for path in (run_dir / "commits").glob("*.jsonl"):
        for record in read_jsonl(path):
            if record["committed"]:
                steps.setdefault(record["inner_step"], set()).add(path.stem)
    return steps


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)
