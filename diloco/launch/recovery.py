"""The recovery choice at a group's death: wait for its replacement, or go on without it.

The supervisor asks here when it notices a death. From what the job has measured (the
survivors' seconds between rounds in their commit logs; how long past replacements took to
ask for a quorum, spares and fresh workers apart) the performance model
(``perf_model.recovery_costs``) prices both options; the cheaper one goes to the lighthouse
(``RecoveryNotice``) before the replacement starts, so the survivors' next rounds either wait
for it, at most its predicted return plus ``cluster.timeouts.recovery``, or stop waiting for
the dead group at once. ``cluster.recovery`` can force either. The choice, its inputs and
both predicted costs go to ``events.jsonl``; summary.json puts the actual cost beside them.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Any

from diloco.config.cluster import group_name
from diloco.config.job import JobConfig
from diloco.ft.client import LighthouseClient
from diloco.ft.protocol import LighthouseRefused, LighthouseUnavailable
from diloco.outer.perf_model import choose_recovery, recovery_costs
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl

log = logging.getLogger(__name__)

# Until the job has measured its own: a warm spare asks for a quorum this soon after the death;
# fresh workers this long after their backoff (forked from the warm server, or exec'd).
FIRST_GUESS_READY_S = {"spare": 0.1, "fork": 0.5, "exec": 8.0}
RECENT = 5  # replacements whose measured times make the estimate
ROUNDS_FOR_WINDOW = 10  # the survivors' last rounds whose spacing is the window
NOTICE_TIMEOUT_S = 2.0  # the supervisor waits no longer than this (or timeouts.connect) to tell the lighthouse


@dataclass
class Pending:
    """A replacement under way: when its group died, which kind, how long it waits to start."""

    group: int
    died_at: float
    kind: str
    delay_s: float


@dataclass
class RecoveryPlanner:
    """The supervisor's recovery choices, and what the job has shown of how long replacements take."""

    job: JobConfig
    paths: RunPaths
    signature: str
    measured: dict[str, list[float]] = field(default_factory=dict)  # kind -> start times after any delay
    pending: list[Pending] = field(default_factory=list)

    def plan(self, group: int, died_at: float, *, spare: bool, delay_s: float, alive: list[int]) -> dict[str, Any]:
        """Choose for ``group``'s replacement (a warm spare, or fresh workers after ``delay_s``),
        tell the lighthouse, and return what to log."""
        self._learn()
        kind = "spare" if spare else self.job.cluster.spawn
        ready_s = delay_s + self._start_estimate(kind)
        others = [g for g in alive if g != group]
        window_s, survivors = self._window_s(others), len(others)
        costs = recovery_costs(ready_s, window_s, survivors)
        forced = self.job.cluster.recovery
        choice = choose_recovery(ready_s, window_s, survivors) if forced == "auto" else forced
        wait_s = ready_s + self.job.cluster.timeouts.recovery if choice == "wait" else 0.0
        told = self._tell(group, wait_s)
        self.pending.append(Pending(group, died_at, kind, delay_s))
        return {
            "choice": choice,
            "replacement": kind,
            "ready_s": round(ready_s, 3),
            "window_s": round(window_s, 3),
            "survivors": survivors,
            "predicted": {k: round(v, 3) for k, v in costs.items()},
            "wait_s": round(wait_s, 3),
            "lighthouse_told": told,
        }

    def _start_estimate(self, kind: str) -> float:
        seen = self.measured.get(kind, [])[-RECENT:]
        return statistics.median(seen) if seen else FIRST_GUESS_READY_S[kind]

    def _learn(self) -> None:
        """Past replacements that have asked for a quorum since: how long they took, their delay left out."""
        for p in list(self.pending):
            first = next((r for r in read_jsonl(self.paths.commits(p.group)) if r["time"] > p.died_at), None)
            if first is not None and "asked_at" in first:
                self.measured.setdefault(p.kind, []).append(max(0.0, first["asked_at"] - p.died_at - p.delay_s))
                self.pending.remove(p)

    def _window_s(self, survivors: list[int]) -> float:
        """The survivors' median seconds between committed rounds (0 before they have two)."""
        gaps: list[float] = []
        for group in survivors:
            times = [r["time"] for r in read_jsonl(self.paths.commits(group)) if r["committed"]]
            recent = times[-ROUNDS_FOR_WINDOW:]
            gaps += [b - a for a, b in zip(recent, recent[1:])]
        return statistics.median(gaps) if gaps else 0.0

    def _tell(self, group: int, wait_s: float) -> bool:
        """Best effort: a lighthouse that is down learns nothing, and its rules apply unchanged."""
        job = self.job
        client = LighthouseClient(
            job.cluster.lighthouse.url(),
            token=job.cluster.lighthouse.token,
            job_id=job.name,
            signature=self.signature,
            group=group_name(group),
            connect_timeout_s=min(job.cluster.timeouts.connect, NOTICE_TIMEOUT_S),
        )
        try:
            client.recovery(round(1000 * wait_s))
        except (LighthouseUnavailable, LighthouseRefused) as error:
            log.warning("could not tell the lighthouse how group %d recovers: %s", group, error)
            return False
        return True
