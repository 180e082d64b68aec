"""Keeps a local job alive: restarts dead groups and a dead lighthouse, fires planned faults, logs every event.

A group that crashes is restarted after a backoff that doubles with each crash, up to a
limit of crashes in a row without progress; a group killed on purpose by the fault plan is
restarted without counting against it. With ``cluster.spares=K`` the supervisor keeps K warm
spares (diloco.worker.spares): a group killed, or crashed after holding the job's state, is handed
to a ready one at once, no backoff, and the pool is refilled in the background. Every return
is a live recovery: the restarted group heals from a peer, never a checkpoint.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any, NoReturn, TextIO

from diloco.exits import JOB_ENDED_EXIT_CODE, REFUSED_EXIT_CODE
from diloco.files import append_text
from diloco.launch.lighthouse_watch import LighthouseWatch
from diloco.launch.local_cluster import JobFailed, LocalCluster, crash_report, refusal
from diloco.launch.progress import format_duration, say
from diloco.launch.recovery import RecoveryPlanner
from diloco.stopped_watch import StoppedWatch
from diloco.train.logger import read_jsonl_tail

LIGHTHOUSE_SETTLED_S = 60.0  # a lighthouse that served this long and then died was not crash-looping


# The console's words for each kind of event; a field the record lacks shows as ``?``.
EVENT_LINES = {
    "kill": "fault: kill group {group} (SIGKILL)",
    "hang": "fault: hang group {group} (SIGSTOP)",
    "break_lane": "fault: break an outer lane of group {group}",
    "nan": "fault: a NaN update from group {group}",
    "resume": "fault over: group {group} resumed (SIGCONT)",
    "lighthouse_down": "fault: lighthouse killed",
    "lighthouse_up": "fault over: lighthouse started again",
    "skipped": "fault skipped: {fault} of group {group} (no group up may take it)",
    "crash": "crash: group {group} rank {rank} exited with code {code}",
    "refused": "refused: group {group} rank {rank} refused the job's configuration",
    "hung": "hung: group {group} rank {rank} stopped for {stopped_s}s, killed",
    "spare_crash": "crash: warm spare {spare} rank {rank} exited with code {code}",
    "lighthouse_crash": "crash: lighthouse exited with code {code}",
    "lighthouse_hung": "hung: lighthouse silent for {silent_s}s, killed",
    "restart": "restart: group {group}",
    "lighthouse_restart": "restart: lighthouse",
    "forkserver_restart": "restart: fork server",
    "plan": "plan: the others go on without waiting for group {group}",
    "stopped_at_end": "stopped: group {group}, still running past the job's end",
    "left_behind": "left behind: group {group}, back after the job's end",
}


def event_line(record: dict[str, Any]) -> str:
    """The console's line for an event: ``fault: kill group 1 (SIGKILL) at 0:15``."""
    kind = record["kind"]
    line = EVENT_LINES.get(kind, kind).format_map(defaultdict(lambda: "?", record))
    if kind == "plan" and record.get("choice") == "wait":
        line = f"plan: the others wait for group {record['group']} (ready in ~{record['ready_s']:.0f}s)"
    if kind == "restart" and record.get("spare") is not None:
        line += f" on warm spare {record['spare']}"
    if "in_a_row" in record:
        line += (
            f" ({record['in_a_row']} in a row; more than cluster.max_restarts={record['max_restarts']} fail the job)"
        )
    return f"{line} at {format_duration(record['elapsed'])}"


class EventLog:
    """``events.jsonl``: one line per fault, crash and restart, with wall and elapsed time; each
    also said on the console (and in run.log) as ``event_line`` words it."""

    def __init__(self, path: Path, start: float, out: TextIO = sys.stdout) -> None:
        self.path = path
        self.start = start
        self.out = out

    def write(self, kind: str, group: int | None = None, **extra: Any) -> None:
        now = time.time()
        record = {"time": now, "elapsed": now - self.start, "kind": kind, "group": group, **extra}
        append_text(self.path, json.dumps(record) + "\n")  # a full disk: OutputError naming events.jsonl
        say(event_line(record), self.out)


class StateHolders:
    """Which processes have held the job's state (they committed a round or healed), from the commit logs."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self._offsets: dict[int, int] = {}
        self._pids: set[int] = set()

    def held_state(self, pid: int) -> bool:
        self._refresh()
        return pid in self._pids

    def current(self) -> set[int]:
        """The groups whose running processes hold the job's state now."""
        self._refresh()
        return {
            g
            for g, workers in self.cluster.groups.items()
            if all(w.process.poll() is None for w in workers) and workers[0].process.pid in self._pids
        }

    def _refresh(self) -> None:
        for group in range(self.cluster.job.cluster.groups):
            path = self.cluster.paths.commits(group)
            records, self._offsets[group] = read_jsonl_tail(path, self._offsets.get(group, 0))
            self._pids.update(r["pid"] for r in records if r.get("committed") or r.get("healed"))


class Supervisor:
    """Restarts the dead groups and the dead lighthouse of a ``LocalCluster`` (limit and backoff from config).

    ``max_restarts`` bounds crash loops: crashes in a row of a group whose processes never
    held the job's state (never committed or healed), deaths in a row of a lighthouse soon
    after its start; the backoff doubles with each.

    Until the job's end a group that dies is restarted, even one killed just before the
    end: the groups that finished wait for it and hand it their final state
    (docs/design.md, invariant 7). A group exits 0 only once the lighthouse has declared the end, and one
    restarted too late exits ``JOB_ENDED_EXIT_CODE``; from either on nothing is restarted,
    and groups still running ``end_grace_s`` later were left behind and are stopped. The
    lighthouse is restarted at once on the same address.

    A group with a worker stopped for longer than ``stopped_limit_s`` (diloco.stopped_watch)
    is killed and restarted like a crashed one, unless the fault plan stopped it
    (``planned_stops``: it resumes it).
    """

    def __init__(
        self,
        cluster: LocalCluster,
        events: EventLog,
        *,
        max_restarts: int,
        backoff_s: float,
        end_grace_s: float,
        spares: int = 0,
        lighthouse_watch: LighthouseWatch | None = None,
        stopped_limit_s: float | None = None,
        planned_stops: Container[int] = (),
    ) -> None:
        self.cluster = cluster
        self.events = events
        self.lighthouse_watch = lighthouse_watch
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.end_grace_s = end_grace_s
        self.spares = spares
        self.stopped_limit_s = stopped_limit_s
        self.planned_stops = planned_stops
        self.stopped = StoppedWatch()
        self.spare_crashes = 0  # spares that died in a row before one took a group over
        self.over_since: float | None = None
        self.crashes: dict[int, int] = {}
        self.lighthouse_crashes = 0  # unplanned deaths in a row, each soon after its start
        self.lighthouse_started_at = 0.0
        self.holders = StateHolders(cluster)
        self.restart_at: dict[int, float] = {}
        self.planner = RecoveryPlanner(cluster.job, cluster.paths, cluster.signature)
        self.finished_groups: set[int] = set()
        self.end_seen = False  # the lighthouse exited 0, or refused a group because the job had ended

    def check(self, now: float) -> None:
        """Notice a dead lighthouse, dead and finished groups; restart groups whose backoff has passed."""
        if not self.job_over and self.cluster.replace_dead_fork_server():
            self.events.write("forkserver_restart")
        self._check_lighthouse(now)
        self._keep_spares()
        for group in range(self.cluster.job.cluster.groups):
            workers = self.cluster.groups.get(group)
            if workers is None:
                if group not in self.restart_at:
                    self._schedule_restart(group, now, crashes=0)  # killed on purpose
            elif all(w.process.poll() == 0 for w in workers):
                self.finished_groups.add(group)
            elif any(w.process.poll() == JOB_ENDED_EXIT_CODE for w in workers):
                self._too_late(group)
            elif any(w.process.poll() == REFUSED_EXIT_CODE for w in workers):
                self._refused(group)
            elif any(w.process.poll() not in (None, 0) for w in workers):
                self._crashed(group, now)
            elif not self.job_over:
                self._check_stopped(group, now)
        if self.job_over:
            self.restart_at.clear()  # the job has ended: a restarted group could not take part any more
            self.over_since = self.over_since if self.over_since is not None else now
            if now - self.over_since > self.end_grace_s:
                self._stop_at_end(self._running())
        for group, at in sorted(self.restart_at.items()):
            if now >= at:
                del self.restart_at[group]
                self._restart(group)

    def _restart(self, group: int) -> None:
        """A warm spare that is ready takes the group over; else fresh workers start."""
        spare = self.cluster.take_spare(group) if self.spares else None
        if spare is None:
            self.cluster.start_group(group)
            self.events.write("restart", group)
            return
        self.spare_crashes = 0
        self.events.write("restart", group, spare=spare)
        self._keep_spares()  # refill the pool now: the next failure may come before the next check

    def _restart_delay(self, crashes: int) -> float:
        """No wait for a group that failed after holding the job's state when spares are kept
        (replacing it at once is their point); else the backoff, doubling per crash in a row."""
        if self.spares and crashes <= 1:
            return 0.0
        return self.backoff_s * 2 ** max(crashes - 1, 0)

    def _keep_spares(self) -> None:
        """Replace dead spares and refill the pool to ``spares``; none once the job is over.

        A spare never exits on its own, so one that did crashed (its log says why); more
        than ``max_restarts`` of them in a row fails the job, as a crash-looping group does.
        """
        for spare in self.cluster.remove_dead_spares():
            self.spare_crashes += 1
            failed = next(w for w in spare.workers if w.process.poll() is not None)
            self.events.write("spare_crash", spare=spare.index, rank=failed.rank, code=failed.process.returncode)
            if self.spare_crashes > self.max_restarts:
                raise JobFailed(
                    f"warm spares failed {self.spare_crashes} times in a row "
                    f"(cluster.max_restarts={self.max_restarts}); "
                    f"{crash_report(failed.log_path)}"
                )
        if self.job_over:
            self.cluster.stop_spares()
            return
        while len(self.cluster.spares) < self.spares:
            self.cluster.start_spare()

    @property
    def job_over(self) -> bool:
        """The job has ended (a group finished, or the lighthouse said so): nothing is restarted any more."""
        return bool(self.finished_groups) or self.end_seen

    def done(self) -> bool:
        """Every group finished, or the job ended while some were down."""
        return self.job_over and not self._running() and not self.restart_at

    def _check_lighthouse(self, now: float) -> None:
        """A lighthouse that died unplanned is restarted at once (it exits 0 only after the job's
        end); one that hung (silent on /alive past ``cluster.timeouts.lighthouse``) is killed first.

        Only deaths in a row within ``LIGHTHOUSE_SETTLED_S`` of a start count toward
        ``max_restarts`` (a crash loop); one that served for longer was killed, not broken.
        """
        lighthouse = self.cluster.lighthouse
        if lighthouse is None:
            return  # a planned outage
        if lighthouse.poll() is None:
            silent_s = self.lighthouse_watch.hung_for(lighthouse.pid) if self.lighthouse_watch else None
            if silent_s is None:
                return  # running
            self.events.write("lighthouse_hung", silent_s=round(silent_s, 1))
            lighthouse.kill()
            lighthouse.wait()
        if lighthouse.poll() == 0:
            self.end_seen = True  # it exits 0 only once the job's end has been served
            return
        if now - self.lighthouse_started_at >= LIGHTHOUSE_SETTLED_S:
            self.lighthouse_crashes = 0
        self.lighthouse_crashes += 1
        self.events.write("lighthouse_crash", code=lighthouse.returncode)
        log_path = self.cluster.paths.logs / "lighthouse.log"
        if self.lighthouse_crashes > self.max_restarts:
            raise JobFailed(
                f"the lighthouse failed {self.lighthouse_crashes} times (cluster.max_restarts={self.max_restarts}); "
                f"{crash_report(log_path)}"
            )
        self.cluster.start_lighthouse()
        self.lighthouse_started_at = now
        self.events.write("lighthouse_restart")

    def _running(self) -> list[int]:
        return [g for g, ws in self.cluster.groups.items() if any(w.process.poll() is None for w in ws)]

    def _stop_at_end(self, groups: list[int]) -> None:
        for group in groups:
            self.cluster.signal_group(group, signal.SIGCONT)
            self.cluster.signal_group(group, signal.SIGKILL)
            self.events.write("stopped_at_end", group)

    def _too_late(self, group: int) -> None:
        """A restarted group came back after the job's end and was refused: left behind, not crashed."""
        self.cluster.signal_group(group, signal.SIGKILL)
        self.end_seen = True
        self.events.write("left_behind", group, reason="the job had ended")

    def _refused(self, group: int) -> NoReturn:
        """A worker refused the job's configuration: every restart would too, so the job fails now."""
        failed = next(w for w in self.cluster.groups[group] if w.process.poll() == REFUSED_EXIT_CODE)
        self._kill(group)
        self.events.write("refused", group, rank=failed.rank)
        said = refusal(failed.log_path) or crash_report(failed.log_path)
        raise JobFailed(f"group {group} rank {failed.rank} refused the job (a restart would too): {said}")

    def _crashed(self, group: int, now: float) -> None:
        workers = self.cluster.groups[group]
        failed = next(w for w in workers if w.process.poll() not in (None, 0))
        leader_pid = self._kill(group)  # a group missing a worker cannot go on
        if self.job_over:  # after the end: it was left behind (refused), there is nothing to restart
            self.events.write("left_behind", group, rank=failed.rank, code=failed.process.returncode)
            return
        self._count_failure(group, leader_pid)
        self.events.write("crash", group, rank=failed.rank, code=failed.process.returncode, **self._in_a_row(group))
        self._restart_failed(group, now, lambda: crash_report(failed.log_path))

    def _check_stopped(self, group: int, now: float) -> None:
        """Kill and restart a running group whose worker has stayed stopped past the limit."""
        if self.stopped_limit_s is None or group in self.planned_stops:
            return
        workers = self.cluster.groups[group]
        found = self.stopped.stopped_for([w.process.pid for w in workers], now)
        if found is None or found[1] <= self.stopped_limit_s:
            return
        pid, stopped_s = found
        rank = next(w.rank for w in workers if w.process.pid == pid)
        self._count_failure(group, self._kill(group))
        self.events.write("hung", group, rank=rank, stopped_s=round(stopped_s, 1), **self._in_a_row(group))
        why = f"its rank {rank} stayed stopped (SIGSTOP or SIGTSTP) for {stopped_s:.0f}s, past cluster.timeouts.stopped"
        self._restart_failed(group, now, lambda: f"{why}={self.stopped_limit_s:g}")

    def _kill(self, group: int) -> int:
        """SIGKILL every worker of ``group`` (stopped ones too) and forget it; its leader's pid."""
        pids = {w.rank: w.process.pid for w in self.cluster.groups[group]}
        self.cluster.signal_group(group, signal.SIGKILL)
        self.stopped.forget(pids.values())
        return pids[0]

    def _count_failure(self, group: int, leader_pid: int) -> None:
        """Failures in a row without progress count: a process that held the job's state ran fine until it failed."""
        self.crashes[group] = 1 if self.holders.held_state(leader_pid) else self.crashes.get(group, 0) + 1

    def _in_a_row(self, group: int) -> dict[str, int]:
        """A failure's count toward the limit, for its record: how close the group is to failing the job."""
        return {"in_a_row": self.crashes[group], "max_restarts": self.max_restarts}

    def _restart_failed(self, group: int, now: float, why: Callable[[], str]) -> None:
        if self.crashes[group] > self.max_restarts:
            raise JobFailed(
                f"group {group} failed {self.crashes[group]} times (cluster.max_restarts={self.max_restarts}); {why()}"
            )
        self._schedule_restart(group, now, self.crashes[group])

    def _schedule_restart(self, group: int, now: float, crashes: int) -> None:
        """Restart ``group`` after its delay; meanwhile the survivors wait for it or go on (diloco.launch.recovery)."""
        if self.job_over:
            return  # nothing is restarted any more
        delay = self._restart_delay(crashes)
        self.restart_at[group] = now + delay
        spare = bool(self.spares and self.cluster.spares) and delay == 0
        alive = [g for g in self._running() if g != group]
        self.events.write(
            "plan", group, **self.planner.plan(group, time.time(), spare=spare, delay_s=delay, alive=alive)
        )
