"""The embedded launcher: starts M replica groups x N worker processes on this machine and watches them.

Each worker is a real process with torchrun's environment, so what runs here is what runs
under torchrun or Slurm on many hosts; only the spawning differs.
"""

from __future__ import annotations

import json
import logging
import math
import os
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
    """A worker exited with an error; the message carries the end of its log."""


@dataclass
class WorkerProcess:
    group: int
    rank: int
    process: subprocess.Popen
    log_path: Path


def free_port(host: str) -> int:
    """A port the OS says is free now, for a group's rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def threads_per_worker(total_workers: int) -> int:
    """Split this machine's cores between its workers so they do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // total_workers)


def spawn_group(job: JobConfig, paths: RunPaths, group: int) -> list[WorkerProcess]:
    """Start the N workers of one replica group, each logging to its own file."""
    n = job.cluster.workers_per_group
    port = free_port(job.cluster.master_addr)
    threads = threads_per_worker(job.cluster.groups * n)
    workers = []
    for rank in range(n):
        env = WorkerEnv(rank=rank, world_size=n, local_rank=rank, master_addr=job.cluster.master_addr, master_port=port)
        log_path = paths.logs / f"group{group}_rank{rank}.log"
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "diloco.worker", "--run-dir", str(paths.root), "--group", str(group)],
                env={**os.environ, **env.to_environ(), "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the launcher alone decides when its workers stop
            )
        workers.append(WorkerProcess(group, rank, process, log_path))
    return workers


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_all(workers: list[WorkerProcess]) -> None:
    """SIGTERM every live worker, then SIGKILL whatever is still there after a grace period."""
    for w in workers:
        if w.process.poll() is None:
            w.process.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for w in workers:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait()


def launch(job: JobConfig, run_dir: Path, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run the whole job on this machine; returns (and writes) the summary."""
    paths = RunPaths(run_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.logs.mkdir(exist_ok=True)
    paths.job.write_text(json.dumps(to_dict(job), indent=2))
    n_params = preflight(job)
    print(
        f"model: {n_params:,} parameters; {job.cluster.groups} group(s) x {job.cluster.workers_per_group} worker(s)",
        file=out,
        flush=True,
    )
    start = time.monotonic()
    workers: list[WorkerProcess] = []
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        for group in range(job.cluster.groups):
            workers += spawn_group(job, paths, group)
        view = ProgressView([paths.metrics(g) for g in range(job.cluster.groups)], job.trainer.max_steps, out=out)
        _wait(workers, view, start)
        view.update(time.monotonic() - start, final=True)
    finally:
        stop_all(workers)
        signal.signal(signal.SIGTERM, previous_sigterm)
    summary = build_summary(job, paths, n_params, wall_seconds=time.monotonic() - start)
    paths.summary.write_text(json.dumps(summary, indent=2))
    return summary


def _wait(workers: list[WorkerProcess], view: ProgressView, start: float) -> None:
    """Until every worker exits; the first failure stops the job with the failing worker's log."""
    while True:
        view.update(time.monotonic() - start)
        for w in workers:
            code = w.process.poll()
            if code not in (None, 0):
                raise JobFailed(
                    f"group {w.group} rank {w.rank} exited with code {code}; last lines of {w.log_path}:\n"
                    + log_tail(w.log_path)
                )
        if all(w.process.poll() == 0 for w in workers):
            return
        time.sleep(POLL_INTERVAL_S)


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
        "per_group": results,
    }


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
