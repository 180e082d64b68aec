"""Starting workers: forked from the fork server or exec'd, their exit codes, and the launcher's lifeline."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diloco.config.base import ConfigError, to_dict
from diloco.launch.forkserver import fork_child
from diloco.launch.launcher import launch
from diloco.launch.local_cluster import JobFailed, LocalCluster, log_tail, serving_pid, wait_until
from diloco.launch.spawn import (
    ForkedProcess,
    ForkServer,
    ForkServerSilent,
    WorkerSpec,
    become_subreaper,
    exec_worker,
)
from diloco.lifeline import Lifeline
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from diloco.worker.builders import preflight
from diloco.worker.env import WorkerEnv
from tests.conftest import FAST, REPO, compose_job, process_exited

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cluster.spawn=fork needs Linux")


def test_cluster_spawn_names_the_allowed_values():
    with pytest.raises(ConfigError, match=r"cluster\.spawn='clone': must be one of fork, exec"):
        compose_job(["cluster.spawn=clone"])
    assert compose_job([]).cluster.spawn == "fork"


def test_a_worker_prefix_wraps_execd_workers_only(tmp_path):
    """The hook netns_link uses: an exec'd worker runs under its group's prefix (here a python
    that prints the command it was handed); a forked one cannot, nor a spare, so both are refused."""
    show = [sys.executable, "-c", "import sys; print(sys.argv[1:])"]
    env = WorkerEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=1)
    log = tmp_path / "worker.log"
    lifeline = Lifeline()
    try:
        exec_worker(WorkerSpec(0, env, 1, log, time.time(), prefix=tuple(show)), tmp_path, lifeline).wait(timeout=30)
    finally:
        lifeline.cut()
    assert log.read_text().startswith(f"['{sys.executable}', '-m', 'diloco.worker', '--run-dir', '{tmp_path}'")
    for overrides in (["cluster.spawn=fork"], ["cluster.spawn=exec", "cluster.spares=1"]):
        with pytest.raises(ValueError, match="cluster.spawn=exec and cluster.spares=0"):
            LocalCluster(compose_job(FAST + overrides), RunPaths(tmp_path / "run"), "sig", {0: show})


def committed(paths: RunPaths, group: int) -> list[dict]:
    return [r for r in read_jsonl(paths.commits(group)) if r["committed"]]


@linux_only
@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [
        # FSDP2 over Gloo inside forked children; min_groups=2: every round has both groups,
        # whichever starts or runs faster, so both runs sync the same rounds
        ["cluster.groups=2", "cluster.workers_per_group=2", "cluster.min_groups=2"],
        ["cluster.groups=1", "cluster.workers_per_group=1"],  # one worker: every core, torch.set_num_threads > 1
    ],
    ids=["2x2", "1x1"],
)
def test_forked_and_execd_workers_train_the_same_model(tmp_path, shape):
    """Same job, both ways of starting workers: same commits, same θ_g digests, same loss."""
    outcomes = {}
    for spawn in ("fork", "exec"):
        job = compose_job(FAST + shape + ["cluster.device=cpu", f"cluster.spawn={spawn}"])
        summary = launch(job, tmp_path / spawn, out=io.StringIO())
        paths = RunPaths(tmp_path / spawn)
        rounds = [[(r["round"], r["digest"]) for r in committed(paths, g)] for g in range(job.cluster.groups)]
        assert all(rounds), f"spawn={spawn}: some group committed no round: {rounds}"
        peaks = [
            line
            for log in paths.logs.glob("group*.log")
            for line in log.read_text().splitlines()
            if line.startswith("peak ")
        ]
        assert peaks and all("measured once by the launcher" in p for p in peaks), f"spawn={spawn}: {peaks}"
        outcomes[spawn] = (rounds, summary["final_eval_loss"])
    assert (tmp_path / "fork" / "logs" / "forkserver.log").exists()
    assert not (tmp_path / "exec" / "logs" / "forkserver.log").exists()
    assert outcomes["fork"] == outcomes["exec"]


# The real fork server, except that its workers, instead of training, say they wait and
# exit with code 3 on SIGUSR1: the exit-code plumbing without the seconds a real worker takes.
WAITING_SERVER = """
import os, signal, sys
import diloco.launch.forkserver as server

def wait_then_exit_3(paths, group, env, started_at, spare=None):
    signal.signal(signal.SIGUSR1, lambda *_: os._exit(3))
    print("waiting", flush=True)
    while True:
        signal.pause()

server.run_launched_worker = wait_then_exit_3
server.main(sys.argv[1:])
"""


@pytest.fixture
def waiting_server(tmp_path):
    """A ForkServer (the real server loop, workers that wait) and a function that forks a ready worker."""
    paths = RunPaths(tmp_path)
    paths.logs.mkdir()
    paths.job.write_text(json.dumps(to_dict(compose_job(FAST + ["cluster.device=cpu"]))))
    script = tmp_path / "waiting_server.py"
    script.write_text(WAITING_SERVER)
    lifeline = Lifeline()
    become_subreaper()
    with (paths.logs / "forkserver.log").open("ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, str(script), "--run-dir", str(tmp_path), *lifeline.argv()],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            pass_fds=(lifeline.read_fd,),
        )
    server = ForkServer(process)
    env = WorkerEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=1)
    logs = iter(paths.logs / f"worker{i}.log" for i in range(1000))

    def fork() -> ForkedProcess:
        log = next(logs)
        worker = server.spawn(WorkerSpec(0, env, 1, log, time.time()), timeout_s=60)
        wait_until(
            lambda: log.exists() and "waiting" in log.read_text(),
            30,
            "the worker's SIGUSR1 handler",
            poll_s=0.05,
            gone=lambda: None if worker.poll() is None else log_tail(log),
        )
        return worker

    yield server, fork
    process.kill()
    process.wait()
    lifeline.cut()  # every worker still waiting dies with it


def is_running(pid: int) -> bool:
    """Alive and not a zombie: /proc/<pid>/stat's state field."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@linux_only
@pytest.mark.slow
def test_forked_process_reports_exit_codes_from_the_server_and_after_it_died(waiting_server):
    server, fork = waiting_server
    first, second = fork(), fork()
    assert first.poll() is None and second.poll() is None
    first.send_signal(signal.SIGUSR1)
    second.kill()
    assert first.wait(timeout=30) == 3
    assert second.wait(timeout=30) == -signal.SIGKILL

    third, fourth = fork(), fork()
    with pytest.raises(subprocess.TimeoutExpired):
        third.wait(timeout=0.2)
    server.process.kill()
    server.process.wait()
    for orphan in (third, fourth):  # re-parented to this process, still running
        assert orphan.poll() is None and is_running(orphan.pid)
    third.send_signal(signal.SIGUSR1)
    fourth.kill()
    assert third.wait(timeout=30) == 3
    assert fourth.wait(timeout=30) == -signal.SIGKILL
    assert not is_running(third.pid) and not is_running(fourth.pid), "reaped, not left as zombies"


@linux_only
def test_a_forked_child_starts_only_once_the_server_said_its_pid(tmp_path):
    """A server gone between its fork and its answer (killed, or stopped and then killed) leaves a
    child the launcher may never have heard of: it must kill itself, not start a second
    lighthouse on the port or a second worker of its rank. Told to go, it starts (here it fails
    at once on an empty request, having made its log)."""
    lifeline = Lifeline()
    request = {"role": "worker", "env": {}, "threads": 1, "group": 0, "started_at": 0.0}
    try:
        for told in (False, True):
            log = tmp_path / f"told-{told}.log"
            pid, go = fork_child({**request, "log": str(log)}, RunPaths(tmp_path), lifeline.read_fd)
            if told:
                os.write(go, b"!")
            os.close(go)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == (1 if told else -signal.SIGKILL)
            assert log.exists() == told
    finally:
        lifeline.cut()


@pytest.mark.slow  # a fork server started and stopped (~2 s)
@linux_only
def test_a_request_to_a_stopped_fork_server_is_given_up_at_once(tmp_path):
    """A stopped server (SIGSTOP) answers nothing: the request gives up once it has been stopped
    for STOPPED_SERVER_S, not after the connect timeout (here 600 s), which is for a server still
    importing; meanwhile the supervisor would restart no other group. One that merely does not
    answer (running) waits out the timeout it was given."""
    idle = [sys.executable, "-c", "import time; time.sleep(600)"]
    for stop in (True, False):
        server = ForkServer(subprocess.Popen(idle, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        try:
            if stop:
                server.process.send_signal(signal.SIGSTOP)
            match = "was stopped" if stop else "within 1s"
            with pytest.raises(ForkServerSilent, match=match):
                server.spawn_lighthouse("sig", tmp_path / "lighthouse.log", timeout_s=600 if stop else 1)
        finally:
            server.process.kill()
            server.process.wait()


FT = FAST + [
    "cluster.device=cpu",
    "cluster.groups=2",
    "cluster.workers_per_group=1",
    "trainer.max_steps=100000",
    "trainer.seq_len=64",
    "trainer.batch_size=4",
    "cluster.timeouts.heartbeat=2",
    "cluster.timeouts.join=1",
    "cluster.timeouts.collective=8",
]


@linux_only
@pytest.mark.slow
def test_killing_the_fork_server_leaves_its_workers_running(tmp_path):
    job = compose_job(FT)
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    cluster = LocalCluster(job, paths, preflight(job, paths)[1])
    try:
        cluster.start_lighthouse()
        for g in range(2):
            cluster.start_group(g)
        cluster.wait_for(lambda: all(committed(paths, g) for g in range(2)), 120, "both groups to commit")
        first_server = cluster.fork_server
        first_server.process.kill()
        first_server.process.wait()
        leader = cluster.groups[0][0].process
        assert leader.poll() is None and is_running(leader.pid)
        before = committed(paths, 0)[-1]["round"]
        cluster.wait_for(lambda: committed(paths, 0)[-1]["round"] > before + 1, 60, "group 0 to go on committing")

        cluster.signal_group(1, signal.SIGKILL)
        cluster.start_group(1)  # starts a new fork server
        assert cluster.fork_server is not first_server and cluster.fork_server.alive()
        restarted = cluster.groups[1][0].process.pid
        cluster.wait_for(
            lambda: any(r["pid"] == restarted for r in committed(paths, 1)), 120, "restarted group 1 to commit"
        )

        # killed after the launcher found it alive, before it answered: a fresh one is asked
        cluster.signal_group(1, signal.SIGKILL)
        second_server = cluster.fork_server
        second_server.process.kill()
        second_server.process.wait()
        second_server.alive = lambda: True
        cluster.start_group(1)
        assert cluster.fork_server is not second_server and cluster.fork_server.alive()
        restarted = cluster.groups[1][0].process.pid
        cluster.wait_for(
            lambda: any(r["pid"] == restarted for r in committed(paths, 1)), 120, "group 1 to commit again"
        )

        # one that served and died is replaced at once, warm for the next need; one that never served is not
        served = cluster.fork_server
        served.process.kill()
        served.process.wait()
        assert cluster.replace_dead_fork_server() and cluster.fork_server is not served
        fresh = cluster.fork_server
        assert not cluster.replace_dead_fork_server()  # alive
        fresh.process.kill()
        fresh.process.wait()
        assert not cluster.replace_dead_fork_server() and cluster.fork_server is fresh
        leader.kill()  # SIGTERM would ask for a planned stop, which ends the worker with INTERRUPTED_EXIT_CODE
        assert leader.wait(timeout=30) == -signal.SIGKILL, "the orphan's exit code is read after its server died"
    finally:
        cluster.stop()
    assert not any(is_running(w.process.pid) for ws in cluster.groups.values() for w in ws)


@linux_only
@pytest.mark.slow
def test_a_fork_server_that_stopped_answering_is_replaced(tmp_path):
    """SIGSTOP of the fork server: alive, it answers no request and reports no exit. A request
    is asked again of a fresh server after cluster.timeouts.connect (before: the job failed), and
    a child's death it leaves unreported gets it killed, so the child is reaped here (before: the
    launcher waited for the report forever)."""
    job = compose_job(FT + ["cluster.timeouts.connect=10"])
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    cluster = LocalCluster(job, paths, preflight(job, paths)[1])
    try:
        cluster.start_lighthouse()
        stopped = cluster.fork_server
        stopped.process.send_signal(signal.SIGSTOP)
        cluster.start_group(0)
        assert cluster.fork_server is not stopped and stopped.process.poll() == -signal.SIGKILL
        assert cluster.groups[0][0].process.poll() is None

        stopped = cluster.fork_server  # now one that stops with children to report
        stopped.process.send_signal(signal.SIGSTOP)
        lighthouse = cluster.lighthouse  # forked by the first server: an orphan of it, ours to reap
        cluster.signal_group(0, signal.SIGKILL)  # waits for the worker's exit
        cluster.kill_lighthouse()
        assert stopped.process.poll() == -signal.SIGKILL and lighthouse.returncode == -signal.SIGKILL
        cluster.start_lighthouse()
        assert serving_pid(cluster.lighthouse_url) == cluster.lighthouse.pid
    finally:
        cluster.stop()


class ServerKiller:
    """SIGKILLs each fork server the cluster starts, the moment it appears (before it served), ``times`` times."""

    def __init__(self, cluster: LocalCluster, times: int) -> None:
        self.cluster, self.times, self.killed = cluster, times, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while len(self.killed) < self.times:
            server = self.cluster.fork_server
            if server is not None and server.process.pid not in self.killed and server.process.poll() is None:
                server.process.kill()
                self.killed.append(server.process.pid)
            time.sleep(0.005)


@linux_only
@pytest.mark.slow
def test_fork_servers_killed_as_the_job_starts_are_replaced_until_the_launch_deadline(tmp_path):
    """A fault at the job's start is a fault like any other: four fork servers killed before they
    started the lighthouse (the job failed at three before) are replaced after a backoff; within a
    deadline shorter than the faults, the start fails saying how many times."""
    job = compose_job(FT + ["cluster.timeouts.connect=10"])
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    cluster = LocalCluster(job, paths, preflight(job, paths)[1])
    try:
        killer = ServerKiller(cluster, times=4)
        cluster.start_lighthouse()
        assert len(killer.killed) == 4 and serving_pid(cluster.lighthouse_url) == cluster.lighthouse.pid
    finally:
        cluster.stop()
    short = compose_job(FT + ["cluster.timeouts.launch=1"])
    paths = RunPaths(tmp_path / "short")
    paths.root.mkdir()
    cluster = LocalCluster(short, paths, preflight(short, paths)[1])
    try:
        ServerKiller(cluster, times=100)
        with pytest.raises(
            JobFailed,
            match=r"the fork server exited before it started the lighthouse \(\d times "
            r"within cluster\.timeouts\.launch=1s\)",
        ):
            cluster.start_lighthouse()
    finally:
        cluster.stop()


class LighthouseFaults:
    """Sends each lighthouse the cluster starts one of ``signals`` in turn, the moment it appears
    (exec'd, it is still importing: before it served)."""

    def __init__(self, cluster: LocalCluster, signals: list[int]) -> None:
        self.cluster, self.signals, self.hit = cluster, signals, []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while len(self.hit) < len(self.signals):
            lighthouse = self.cluster.lighthouse
            if lighthouse is not None and lighthouse.pid not in self.hit and lighthouse.poll() is None:
                os.kill(lighthouse.pid, self.signals[len(self.hit)])
                self.hit.append(lighthouse.pid)
            time.sleep(0.005)


@linux_only
@pytest.mark.slow
def test_a_lighthouse_killed_or_stopped_before_it_served_is_replaced_until_the_launch_deadline(tmp_path):
    """A lighthouse SIGKILLed or SIGSTOPped as the job starts is replaced after a backoff (before, a
    stopped one failed the job after cluster.timeouts.connect); past the deadline the start fails
    saying what happened and how often."""
    job = compose_job(FT + ["cluster.spawn=exec", "cluster.timeouts.connect=20"])
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    cluster = LocalCluster(job, paths, preflight(job, paths)[1])
    try:
        faults = LighthouseFaults(cluster, [signal.SIGSTOP, signal.SIGKILL, signal.SIGSTOP])
        cluster.start_lighthouse()
        assert len(faults.hit) == 3 and serving_pid(cluster.lighthouse_url) == cluster.lighthouse.pid
        assert cluster.lighthouse.pid not in faults.hit
    finally:
        cluster.stop()
    short = compose_job(FT + ["cluster.spawn=exec", "cluster.timeouts.launch=1"])
    paths = RunPaths(tmp_path / "short")
    paths.root.mkdir()
    cluster = LocalCluster(short, paths, preflight(short, paths)[1])
    try:
        LighthouseFaults(cluster, [signal.SIGSTOP] * 100)
        match = (
            r"the lighthouse was stopped \(SIGSTOP\) before it served \(\d times within cluster\.timeouts\.launch=1s\)"
        )
        with pytest.raises(JobFailed, match=match):
            cluster.start_lighthouse()
    finally:
        cluster.stop()
    assert not job_processes(tmp_path)


def job_processes(run_dir: Path) -> list[int]:
    """Live processes whose command line names ``run_dir``: the lighthouse, the fork server, its
    forked workers (they keep the server's command line) and exec'd workers. Zombies have none."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(run_dir).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@linux_only
@pytest.mark.slow
@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_a_sigkilled_launcher_leaves_no_process_behind(tmp_path, spawn):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "run.py", "logger=none", "trainer.max_steps=100000", "algo.sync_every=10"]
        + [f"cluster.spawn={spawn}", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            (run_dir / "commits" / "group0.jsonl").exists, 120, "the job to start", 0.5, process_exited(launcher)
        )
        expected = 5 + (spawn == "fork")  # lighthouse (+ fork server) + 2 groups x 2 workers
        assert len(job_processes(run_dir)) >= expected
        launcher.kill()
        launcher.wait()
        wait_until(lambda: not job_processes(run_dir), 10, "the processes of a killed launcher's job to end")
    finally:
        if launcher.poll() is None:
            launcher.kill()
