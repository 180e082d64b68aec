"""Stand-in processes for the supervisor's rule tests: a real LocalCluster whose groups are
short shell processes, and whose group starts are recorded instead of spawning workers."""

from __future__ import annotations

import subprocess
from pathlib import Path

from diloco.launch.lighthouse_watch import LighthouseWatch
from diloco.launch.local_cluster import LocalCluster, WorkerProcess
from diloco.launch.supervisor import EventLog, Supervisor
from diloco.run_paths import RunPaths
from tests.conftest import compose_job


def exited(code: int) -> subprocess.Popen:
    process = subprocess.Popen(["sh", "-c", f"exit {code}"])
    process.wait()
    return process


def running() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def worker(group: int, process: subprocess.Popen) -> WorkerProcess:
    return WorkerProcess(group, 0, process, Path("/dev/null"))


def supervise(
    tmp_path: Path,
    processes: dict[int, subprocess.Popen],
    lighthouse: subprocess.Popen | None = None,
    *,
    max_restarts: int = 1,
    backoff_s: float = 0.0,
    spares: int = 0,
    lighthouse_watch: LighthouseWatch | None = None,
    stopped_limit_s: float | None = None,
    planned_stops: tuple[int, ...] = (),
) -> Supervisor:
    """A supervisor over a real LocalCluster of 3 groups holding ``processes`` (group -> its one
    worker); starting a group, or the lighthouse, records it in ``cluster.started`` and starts a
    stand-in process."""
    cluster = LocalCluster(compose_job(["logger=none", "cluster.groups=3"]), RunPaths(tmp_path), "sig")
    cluster.groups = {g: [worker(g, p)] for g, p in processes.items()}
    cluster.lighthouse = lighthouse
    cluster.started = []

    def start_group(group: int) -> None:
        cluster.started.append(group)
        cluster.groups[group] = [worker(group, running())]

    def start_lighthouse() -> None:
        cluster.started.append("lighthouse")
        cluster.lighthouse = running()

    cluster.start_group = start_group
    cluster.start_lighthouse = start_lighthouse
    events = EventLog(cluster.paths.events, 0.0)
    return Supervisor(
        cluster,
        events,
        max_restarts=max_restarts,
        backoff_s=backoff_s,
        end_grace_s=60.0,
        spares=spares,
        lighthouse_watch=lighthouse_watch,
        stopped_limit_s=stopped_limit_s,
        planned_stops=planned_stops,
    )
