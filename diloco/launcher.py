"""The embedded launcher: a lighthouse plus M replica groups x N worker processes on this machine.

Each worker is a real process with torchrun's environment, so what runs here is what runs
under torchrun or Slurm on many hosts; only the spawning differs. ``LocalCluster`` owns the
processes, so a test or a fault injector can kill, stop and restart any part of the job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from diloco.config import JobConfig
from diloco.config_base import to_dict
from diloco.distributed import WorkerEnv
from diloco.faults import request_fault
from diloco.worker import RunPaths

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
TERMINATE_GRACE_S = 10.0
LOG_TAIL_LINES = 20


class JobFailed(RuntimeError):
    """A process of the job failed; the message carries the end of its log."""


@dataclass
class WorkerProcess:
    group: int
    rank: int
    process: subprocess.Popen
    log_path: Path


def free_port(host: str) -> int:
    """A port the OS says is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def threads_per_worker(total_workers: int) -> int:
    """Split this machine's cores between its workers so they do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // total_workers)


def resolve_lighthouse(job: JobConfig) -> JobConfig:
    """Fill in what a local job leaves open: a free port and a fresh secret token."""
    lighthouse = job.cluster.lighthouse
    lighthouse = dataclasses.replace(
        lighthouse,
        port=lighthouse.port or free_port(lighthouse.host),
        token=lighthouse.token or secrets.token_hex(16),
    )
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, lighthouse=lighthouse))


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """SIGTERM (and SIGCONT, in case one is stopped), then SIGKILL what is left after a grace period."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
            process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class LocalCluster:
    """The processes of one job on this machine: a lighthouse and every group's workers."""

    def __init__(self, job: JobConfig, paths: RunPaths, signature: str) -> None:
        self.job = resolve_lighthouse(job)
        self.paths = paths
        self.signature = signature
        self.lighthouse: subprocess.Popen | None = None
        self.groups: dict[int, list[WorkerProcess]] = {}
        paths.logs.mkdir(parents=True, exist_ok=True)
        paths.job.touch(mode=0o600)  # it holds the token: only its owner may read it
        paths.job.write_text(json.dumps(to_dict(self.job), indent=2))

    @property
    def lighthouse_url(self) -> str:
        return f"http://{self.job.cluster.lighthouse.host}:{self.job.cluster.lighthouse.port}"

    def start_lighthouse(self) -> None:
        """Start the lighthouse and wait (bounded by the connect timeout) until it listens."""
        with (self.paths.logs / "lighthouse.log").open("ab") as log_file:
            self.lighthouse = subprocess.Popen(
                [sys.executable, "-m", "diloco.ft", "--run-dir", str(self.paths.root), "--signature", self.signature],
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        cfg = self.job.cluster.lighthouse
        deadline = time.monotonic() + self.job.cluster.timeouts.connect
        while time.monotonic() < deadline:
            if self.lighthouse.poll() is not None:
                raise JobFailed(
                    f"the lighthouse exited with code {self.lighthouse.returncode}:\n"
                    + log_tail(self.paths.logs / "lighthouse.log")
                )
            try:
                with socket.create_connection((cfg.host, cfg.port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.1)
        raise JobFailed(
            f"the lighthouse did not listen on {cfg.host}:{cfg.port} in {self.job.cluster.timeouts.connect}s"
        )

    def kill_lighthouse(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait()

    def start_group(self, group: int) -> None:
        """Start the N workers of one replica group, each logging to its own file."""
        n = self.job.cluster.workers_per_group
        port = free_port(self.job.cluster.master_addr)
        threads = threads_per_worker(self.job.cluster.groups * n)
        started_at = time.time()
        workers = []
        for rank in range(n):
            env = WorkerEnv(
                rank=rank, world_size=n, local_rank=rank, master_addr=self.job.cluster.master_addr, master_port=port
            )
            log_path = self.paths.logs / f"group{group}_rank{rank}.log"
            with log_path.open("ab") as log_file:
                process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "diloco.worker",
                        "--run-dir",
                        str(self.paths.root),
                        "--group",
                        str(group),
                        "--started-at",
                        str(started_at),
                    ],
                    env={**os.environ, **env.to_environ(), "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"},
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # the launcher alone decides when its workers stop
                )
            workers.append(WorkerProcess(group, rank, process, log_path))
        self.groups[group] = workers

    def signal_group(self, group: int, signum: int) -> None:
        """Send ``signum`` to every worker of ``group`` (SIGKILL, SIGSTOP, SIGCONT, SIGUSR1...).

        A killed group is forgotten (it is not a failure of the job) until it is started again.
        """
        for w in self.groups[group]:
            if w.process.poll() is None:
                w.process.send_signal(signum)
        if signum == signal.SIGKILL:
            for w in self.groups.pop(group):
                w.process.wait()

    def request_fault(self, group: int, fault: str) -> None:
        """Make ``group`` inject ``fault`` into its next round (see Synchronizer.inject)."""
        request_fault(self.paths.fault_requests(group), fault)

    def failed_worker(self) -> WorkerProcess | None:
        """A worker that exited with an error, if any."""
        for workers in self.groups.values():
            for w in workers:
                if w.process.poll() not in (None, 0):
                    return w
        return None

    def finished(self) -> bool:
        return all(w.process.poll() == 0 for workers in self.groups.values() for w in workers)

    def stop(self) -> None:
        """Stop every process of the job; nothing is left behind."""
        processes = [w.process for workers in self.groups.values() for w in workers]
        stop_processes(processes + ([self.lighthouse] if self.lighthouse else []))
