"""``python run.py`` on one machine: the lighthouse, every group, the supervisor, planned faults, progress."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from diloco.config.base import ConfigError
from diloco.config.job import JobConfig
from diloco.files import write_json_atomically, writing
from diloco.huge_pages import huge_pages_line
from diloco.launch.faults import FaultInjector, plan_faults
from diloco.launch.header import header_lines
from diloco.launch.lighthouse_watch import LighthouseWatch
from diloco.launch.local_cluster import POLL_INTERVAL_S, JobFailed, LocalCluster
from diloco.launch.progress import ProgressView, say
from diloco.launch.summary import build_summary, interrupted_summary
from diloco.launch.supervisor import EventLog, Supervisor
from diloco.run_paths import RunPaths
from diloco.train.checkpoint import describe_resume, resume_source
from diloco.worker.builders import preflight, resume_folders

FAULT_HORIZON_S = 7 * 24 * 3600.0  # the plan outlasts any local run; firing stops when the job ends


def launch(
    job: JobConfig, run_dir: Path, out: TextIO = sys.stdout, worker_prefix: Mapping[int, Sequence[str]] | None = None
) -> dict[str, Any]:
    """Run the whole job on this machine; returns (and writes) the summary.

    The summary's ``ok`` says whether model.pt is the final global model every group holds
    (``failure`` says why not). A job the supervisor gave up on raises ``JobFailed`` after
    writing its summary. Ctrl-C or SIGTERM is a planned stop: every group stops after its
    current round (saving its checkpoint if ``trainer.checkpoint.every`` is set), model.pt
    gets the newest committed global model, summary.json says ``interrupted``, and
    ``JobInterrupted`` is raised; a second Ctrl-C stops every process at once.
    ``worker_prefix``: per group, a command its workers run under (``LocalCluster``).
    """
    paths = RunPaths(run_dir)
    with run_dir_claimed(paths):
        return _launch_claimed(job, paths, out, worker_prefix)


def pin_resume(job: JobConfig, paths: RunPaths, out: TextIO) -> JobConfig:
    """``job`` with ``trainer.resume`` resolved once, and said in one line: ``latest`` or ``auto``
    becomes the run it found ("" for a fresh start), so the preflight and every worker, a group
    restarted hours later too, read the same checkpoints, whatever other runs write meanwhile."""
    if not job.trainer.resume:
        return job
    spec, search_dir = job.trainer.resume, Path(job.trainer.checkpoint.search_dir)
    source = resume_source(spec, paths.root, search_dir)
    pinned = dataclasses.replace(job, trainer=dataclasses.replace(job.trainer, resume=str(source or "")))
    say(describe_resume(spec, resume_folders(pinned, paths), search_dir), out)
    return pinned


def _launch_claimed(
    job: JobConfig, paths: RunPaths, out: TextIO, worker_prefix: Mapping[int, Sequence[str]] | None = None
) -> dict[str, Any]:
    job = pin_resume(job, paths, out)
    warnings: list[str] = []
    n_params, signature = preflight(job, paths, warnings.append)
    cluster = LocalCluster(job, paths, signature, worker_prefix)
    status_url = cluster.lighthouse_url if job.algo.name != "local" else None  # algo=local runs no lighthouse
    for line in [*header_lines(job, n_params, status_url, paths.root, huge_pages_line()), *warnings]:
        say(line, out)
    start = time.monotonic()
    events = EventLog(paths.events, time.time(), out)
    watch = LighthouseWatch(cluster.lighthouse_url, job.cluster.timeouts.lighthouse)
    injector = FaultInjector(
        cluster,
        plan_faults(job.faults, job.cluster.groups, FAULT_HORIZON_S),
        events,
        hang_s=job.faults.hang_seconds,
        down_s=job.faults.lighthouse_down_seconds,
        min_alive=job.faults.min_alive,
    )
    supervisor = Supervisor(
        cluster,
        events,
        max_restarts=job.cluster.max_restarts,
        backoff_s=job.cluster.restart_backoff,
        end_grace_s=job.cluster.timeouts.quorum,
        spares=job.cluster.spares,
        lighthouse_watch=watch,
        stopped_limit_s=job.cluster.timeouts.stopped,
        planned_stops=injector.resume_at,  # the fault plan resumes what it stopped
    )
    # Both explicitly: a launcher started with SIGINT ignored (a background job of a
    # non-interactive shell) still stops as planned on Ctrl-C.
    previous = {s: signal.signal(s, _raise_keyboard_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    planned_stop = False
    view = ProgressView.for_job(job, paths, out)
    try:
        if job.algo.name != "local":
            cluster.start_lighthouse()
            watch.start()
        for group in range(job.cluster.groups):
            cluster.start_group(group)
        while not supervisor.done():
            elapsed = time.monotonic() - start
            # Planned faults go on through the job's closing rounds, until a group has left.
            injector.fire_due(elapsed, new_faults=not supervisor.job_over)
            supervisor.check(elapsed)
            view.update(elapsed)
            cluster.nap(POLL_INTERVAL_S)
    except JobFailed as failure:
        cluster.stop()
        summary = build_summary(job, paths, n_params, wall_seconds=time.monotonic() - start)
        write_json_atomically(paths.summary, summary | {"ok": False, "failure": str(failure).splitlines()[0]})
        raise
    except KeyboardInterrupt:
        planned_stop = True
        _stop_planned(cluster, job.cluster.timeouts.stop, out)
    finally:
        watch.close()
        cluster.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    summary = build_summary(job, paths, n_params, wall_seconds=time.monotonic() - start)
    if planned_stop and not summary["ok"]:  # (a stop asked for after every group had finished changes nothing)
        summary |= interrupted_summary(paths, summary)
        write_json_atomically(paths.summary, summary)
        raise JobInterrupted(summary["failure"])
    write_json_atomically(paths.summary, summary)
    view.finish(summary["wall_seconds"], summary["tokens_per_s"])  # the done line's rate, summary.json's
    return summary


class JobInterrupted(KeyboardInterrupt):
    """A planned stop (Ctrl-C, SIGTERM) ended the job; its summary and newest global model are written."""


def _stop_planned(cluster: LocalCluster, timeout_s: float, out: TextIO) -> None:
    say(f"stopping: each group stops after its current round (up to {timeout_s:g}s; Ctrl-C again: at once)", out)
    try:
        if not cluster.stop_planned(timeout_s):
            say(f"stopping: some workers were still running after {timeout_s:g}s (cluster.timeouts.stop)", out)
    except KeyboardInterrupt:
        say("stopping at once", out)


_CLAIMED: dict[Path, TextIO] = {}  # run directory -> its open lock file, while this process runs a job there


@contextlib.contextmanager
def run_dir_claimed(paths: RunPaths) -> Iterator[None]:
    """Hold the run directory for one launcher: a second one started on the same hydra.run.dir
    is refused at once (it would otherwise overwrite config.yaml and fight over the lighthouse
    port until both failed), and one started after the job finds its outputs. Reentrant."""
    if paths.root in _CLAIMED:
        yield
        return
    paths.root.mkdir(parents=True, exist_ok=True)
    with _locked_file(paths) as lock:
        try:
            with writing(paths.launcher_lock):  # a full disk: OutputError naming the file
                lock.truncate(0)
                lock.write(f"{os.getpid()}\n")
                lock.flush()
            _CLAIMED[paths.root] = lock
            refuse_reused_run_dir(paths)
            yield
        finally:
            _CLAIMED.pop(paths.root, None)
            paths.launcher_lock.unlink(missing_ok=True)  # while still locked: no finished run keeps a stale lock


def _locked_file(paths: RunPaths) -> TextIO:
    """``launcher.lock`` opened and locked by this process, or ConfigError naming the launcher holding it.

    The holder removes the file while it still holds the lock, so a lock won on a file opened
    just before that removal locks a file no longer there: then it is opened and locked anew."""
    while True:
        lock = open(paths.launcher_lock, "a+")  # noqa: SIM115 - closed by the claim that gets it, or below
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            lock.close()
            raise ConfigError(
                f"hydra.run.dir={paths.root}: another launcher (pid {holder}) is running a job there; "
                "pick a new hydra.run.dir"
            ) from None
        if _is_the_file_at(lock, paths.launcher_lock):
            return lock
        lock.close()


def _is_the_file_at(handle: TextIO, path: Path) -> bool:
    """Whether ``path`` still names the file ``handle`` has open (not removed or replaced since)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(handle.fileno())
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def refuse_reused_run_dir(paths: RunPaths) -> None:
    """A run directory holds one run: appending a second one's logs would mix and double-count both."""
    if found := paths.outputs_present():
        raise ConfigError(
            f"hydra.run.dir={paths.root}: already holds a run ({', '.join(found)}); "
            "pick a new hydra.run.dir (or remove the old run)"
        )


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
