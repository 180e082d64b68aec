"""The embedded launcher: a lighthouse plus M replica groups x N worker processes on this machine.

Each worker is a real process with torchrun's environment, so what runs here is what runs
under torchrun or Slurm on many hosts; only the spawning differs. ``LocalCluster`` owns the
processes, so a test or a fault injector can kill, stop and restart any part of the job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from diloco.config import JobConfig
from diloco.config_base import to_dict
from diloco.distributed import WorkerEnv
from diloco.progress import ProgressView
from diloco.worker import RunPaths, preflight

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
        workers = []
        for rank in range(n):
            env = WorkerEnv(
                rank=rank, world_size=n, local_rank=rank, master_addr=self.job.cluster.master_addr, master_port=port
            )
            log_path = self.paths.logs / f"group{group}_rank{rank}.log"
            with log_path.open("ab") as log_file:
                process = subprocess.Popen(
                    [sys.executable, "-m", "diloco.worker", "--run-dir", str(self.paths.root), "--group", str(group)],
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


def launch(job: JobConfig, run_dir: Path, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the whole job on this machine; returns (and writes) the summary."""
    paths = RunPaths(run_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    n_params, signature = preflight(job)
    cluster = LocalCluster(job, paths, signature)
    print(
        f"model: {n_params:,} parameters; {job.cluster.groups} group(s) x {job.cluster.workers_per_group} "
        f"worker(s); lighthouse status page {cluster.lighthouse_url}/",
        file=out,
        flush=True,
    )
    start = time.monotonic()
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        if job.algo.name != "local":
            cluster.start_lighthouse()
        for group in range(job.cluster.groups):
            cluster.start_group(group)
        view = ProgressView([paths.metrics(g) for g in range(job.cluster.groups)], job.trainer.max_steps, out=out)
        while not cluster.finished():
            view.update(time.monotonic() - start)
            failed = cluster.failed_worker()
            if failed is not None:
                raise JobFailed(
                    f"group {failed.group} rank {failed.rank} exited with code {failed.process.returncode}; "
                    f"last lines of {failed.log_path}:\n" + log_tail(failed.log_path)
                )
            time.sleep(POLL_INTERVAL_S)
        view.update(time.monotonic() - start, final=True)
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous_sigterm)
    summary = build_summary(job, paths, n_params, wall_seconds=time.monotonic() - start)
    paths.summary.write_text(json.dumps(summary, indent=2))
    return summary


def build_summary(job: JobConfig, paths: RunPaths, n_params: int, wall_seconds: float) -> dict[str, Any]:
    """Job-level numbers from each group's result file (means over groups, sums of tokens)."""
    results = [json.loads(paths.result(g).read_text()) for g in range(job.cluster.groups)]
    tokens = sum(r["tokens_seen"] for r in results)
    train_seconds = max(r["train_seconds"] for r in results)
    eval_loss = _mean(r["final_eval_loss"] for r in results)
    return {
        "name": job.name,
        "parameters": n_params,
        "groups": job.cluster.groups,
        "workers_per_group": job.cluster.workers_per_group,
        "steps": min(r["steps"] for r in results),
        "final_train_loss": _mean(r["final_train_loss"] for r in results),
        "final_eval_loss": eval_loss,
        "final_eval_ppl": math.exp(min(eval_loss, 50.0)),
        "tokens_seen": tokens,
        "wall_seconds": wall_seconds,
        "train_seconds": train_seconds,
        "tokens_per_s": tokens / train_seconds if train_seconds > 0 else 0.0,
        "rounds": max(r.get("rounds", 0) for r in results),
        "syncs_committed": sum(r.get("syncs_committed", 0) for r in results),
        "syncs_attempted": sum(r.get("syncs_attempted", 0) for r in results),
        "bytes_sent": sum(r.get("bytes_sent", 0) for r in results),
        "bytes_per_token": sum(r.get("bytes_sent", 0) for r in results) / tokens if tokens else 0.0,
        "recoveries": sum(r.get("recoveries", 0) for r in results),
        "per_group": results,
    }


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
