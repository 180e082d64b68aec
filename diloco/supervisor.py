"""Keeps a local job alive: restarts dead groups, fires planned faults, logs every event.

A group that crashes is restarted after a backoff that doubles with each crash, up to a
limit; a group killed on purpose by the fault plan is restarted without counting against it.
Every return is a live recovery: the restarted group heals from a peer, never a checkpoint.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from diloco.faults import FaultEvent
from diloco.launcher import JobFailed, LocalCluster, log_tail
from diloco.metrics import read_jsonl_tail

log = logging.getLogger(__name__)


class EventLog:
    """``events.jsonl``: one line per fault, crash and restart, with wall and elapsed time."""

    def __init__(self, path: Path, start: float) -> None:
        self.path = path
        self.start = start

    def write(self, kind: str, group: int | None = None, **extra: Any) -> None:
        now = time.time()
        record = {"time": now, "elapsed": now - self.start, "kind": kind, "group": group, **extra}
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        log.info("%s%s at %.1fs", kind, "" if group is None else f" group {group}", record["elapsed"])


class Supervisor:
    """Restarts dead groups of a ``LocalCluster`` (limit and backoff from config)."""

    def __init__(
        self,
        cluster: LocalCluster,
        events: EventLog,
        *,
        max_restarts: int,
        backoff_s: float,
        end_grace_s: float,
        orphan_grace_s: float,
    ) -> None:
        self.cluster = cluster
        self.events = events
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.end_grace_s = end_grace_s
        self.orphan_grace_s = orphan_grace_s
        self.first_finish_at: float | None = None
        self.orphan_since: float | None = None
        self.committed_pids: set[int] = set()
        self.crashes: dict[int, int] = {}
        self.restart_at: dict[int, float] = {}
        self.finished_groups: set[int] = set()

    def check(self, now: float) -> None:
        """Notice dead and finished groups, and restart those whose backoff has passed."""
        for group in range(self.cluster.job.cluster.groups):
            workers = self.cluster.groups.get(group)
            if workers is None:
                self.restart_at.setdefault(group, now + self.backoff_s)  # killed on purpose
            elif all(w.process.poll() == 0 for w in workers):
                self.finished_groups.add(group)
            elif any(w.process.poll() not in (None, 0) for w in workers):
                self._crashed(group, now)
        if self.finished_groups:
            self.restart_at.clear()  # the job is ending: a restarted group could not heal from anyone
            self.first_finish_at = self.first_finish_at if self.first_finish_at is not None else now
            if now - self.first_finish_at > self.end_grace_s:
                self._stop_stragglers()
            self._stop_orphans(now)
        for group, at in sorted(self.restart_at.items()):
            if now >= at:
                del self.restart_at[group]
                self.cluster.start_group(group)
                self.events.write("restart", group)

    def done(self) -> bool:
        """Every group finished, or the job ended while some were down."""
        return bool(self.finished_groups) and not self._running() and not self.restart_at

    def _running(self) -> list[int]:
        return [g for g, ws in self.cluster.groups.items() if any(w.process.poll() is None for w in ws)]

    def _stop_at_end(self, groups: list[int], **extra: Any) -> None:
        for group in groups:
            self.cluster.signal_group(group, signal.SIGCONT)
            self.cluster.signal_group(group, signal.SIGKILL)
            self.events.write("stopped_at_end", group, **extra)

    def _stop_stragglers(self) -> None:
        """Groups still running long after others finished are behind for good: no peer is left to heal them."""
        self._stop_at_end(self._running())

    def _stop_orphans(self, now: float) -> None:
        """Once some group finished, stop at once the running groups when none of them committed since it started.

        Such groups (typically restarted just before the end) have nobody left to heal
        from: they could only train alone from stale state until ``max_steps``. Waiting
        ``orphan_grace_s`` covers a commit record that is still being written.
        """
        if self.cluster.job.algo.name == "local":
            return  # groups never sync: each one finishes on its own
        running = self._running()
        if not running or any(self._committed_since_start(g) for g in running):
            self.orphan_since = None
            return
        self.orphan_since = self.orphan_since if self.orphan_since is not None else now
        if now - self.orphan_since >= self.orphan_grace_s:
            self._stop_at_end(running, reason="no peer left to heal from")

    def _committed_since_start(self, group: int) -> bool:
        pid = next(w for w in self.cluster.groups[group] if w.rank == 0).process.pid
        if pid not in self.committed_pids:  # read the commit log until this process is seen committing
            records, _ = read_jsonl_tail(self.cluster.paths.commits(group), 0)
            if any(r.get("committed") and r.get("pid") == pid for r in records):
                self.committed_pids.add(pid)
        return pid in self.committed_pids

    def _crashed(self, group: int, now: float) -> None:
        workers = self.cluster.groups[group]
        failed = next(w for w in workers if w.process.poll() not in (None, 0))
        self.cluster.signal_group(group, signal.SIGKILL)  # a group missing a worker cannot go on
        self.crashes[group] = self.crashes.get(group, 0) + 1
        self.events.write("crash", group, rank=failed.rank, code=failed.process.returncode)
        if self.crashes[group] > self.max_restarts:
            raise JobFailed(
                f"group {group} failed {self.crashes[group]} times (cluster.max_restarts={self.max_restarts}); "
                f"last lines of {failed.log_path}:\n{log_tail(failed.log_path)}"
            )
        self.restart_at[group] = now + self.backoff_s * 2 ** (self.crashes[group] - 1)


class FaultInjector:
    """Fires a fault plan against the cluster's real processes as time passes."""

    def __init__(
        self, cluster: LocalCluster, plan: list[FaultEvent], events: EventLog, *, hang_s: float, down_s: float
    ):
        self.cluster = cluster
        self.plan = list(plan)
        self.events = events
        self.hang_s = hang_s
        self.down_s = down_s
        self.resume_at: dict[int, float] = {}
        self.lighthouse_back_at: float | None = None

    def fire_due(self, now: float, new_faults: bool = True) -> None:
        """Undo due hangs and lighthouse outages; with ``new_faults``, fire the plan's due faults."""
        for group, at in list(self.resume_at.items()):
            if now >= at and group in self.cluster.groups:
                del self.resume_at[group]
                self.cluster.signal_group(group, signal.SIGCONT)
                self.events.write("resume", group)
        if self.lighthouse_back_at is not None and now >= self.lighthouse_back_at:
            self.lighthouse_back_at = None
            self.cluster.start_lighthouse()
            self.events.write("lighthouse_up")
        while new_faults and self.plan and self.plan[0].at <= now:
            self._fire(self.plan.pop(0), now)

    def _fire(self, event: FaultEvent, now: float) -> None:
        if event.kind == "restart_lighthouse":
            if self.lighthouse_back_at is None:
                self.cluster.kill_lighthouse()
                self.lighthouse_back_at = now + self.down_s
                self.events.write("lighthouse_down")
            return
        group = event.group
        if group not in self.cluster.groups or group in self.resume_at:
            self.events.write("skipped", group, fault=event.kind)  # the group is down or already hung
            return
        if event.kind == "kill":
            self.cluster.signal_group(group, signal.SIGKILL)
        elif event.kind == "hang":
            self.cluster.signal_group(group, signal.SIGSTOP)
            self.resume_at[group] = now + self.hang_s
        else:
            self.cluster.request_fault(group, event.kind)
        self.events.write(event.kind, group)
