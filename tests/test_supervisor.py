"""The supervisor's end-of-job rules, on a stand-in cluster of real, short-lived processes."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from diloco.local_cluster import WorkerProcess
from diloco.logger import read_jsonl
from diloco.run_paths import RunPaths
from diloco.supervisor import EventLog, Supervisor
from diloco.worker import JOB_ENDED_EXIT_CODE


def exited(code: int) -> subprocess.Popen:
    process = subprocess.Popen(["sh", "-c", f"exit {code}"])
    process.wait()
    return process


def running() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


@dataclass
class StandInCluster:
    """What the supervisor uses of a LocalCluster: processes by group, the lighthouse, start and signal."""

    paths: RunPaths
    groups: dict[int, list[WorkerProcess]]
    lighthouse: subprocess.Popen | None = None
    started: list[int] = field(default_factory=list)

    @property
    def job(self) -> SimpleNamespace:
        return SimpleNamespace(cluster=SimpleNamespace(groups=3))

    def start_group(self, group: int) -> None:
        self.started.append(group)
        self.groups[group] = [WorkerProcess(group, 0, running(), Path("/dev/null"))]

    def start_lighthouse(self) -> None:
        raise AssertionError("the lighthouse must not be restarted here")

    def signal_group(self, group: int, signum: int) -> None:
        for w in self.groups[group]:
            if w.process.poll() is None:
                w.process.send_signal(signum)
        if signum == signal.SIGKILL:
            for w in self.groups.pop(group):
                w.process.wait()

    def stop(self) -> None:
        for group in list(self.groups):
            self.signal_group(group, signal.SIGKILL)


def supervise(tmp_path: Path, processes: dict[int, subprocess.Popen], lighthouse=None) -> Supervisor:
    paths = RunPaths(tmp_path)
    paths.root.mkdir(parents=True, exist_ok=True)
    groups = {g: [WorkerProcess(g, 0, p, Path("/dev/null"))] for g, p in processes.items()}
    cluster = StandInCluster(paths, groups, lighthouse)
    return Supervisor(cluster, EventLog(paths.events, 0.0), max_restarts=1, backoff_s=0.0, end_grace_s=60.0)


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
        assert [e["kind"] for e in read_jsonl(supervisor.cluster.paths.events)] == ["crash", "restart"]
    finally:
        supervisor.cluster.stop()


def test_a_lighthouse_that_exited_0_ended_the_job_and_a_group_killed_then_is_not_restarted(tmp_path):
    supervisor = supervise(tmp_path, {0: running(), 2: running()}, lighthouse=exited(0))  # group 1 was killed
    try:
        supervisor.check(now=1.0)
        assert supervisor.job_over and not supervisor.cluster.started
    finally:
        supervisor.cluster.stop()
