"""Deterministic fault injection: which fault hits which group when, as a pure plan.

The launcher fires the plan against real processes (SIGKILL, SIGSTOP/SIGCONT, a killed
lighthouse, and requests the workers pick up at their next round: a broken lane, a NaN
update, a failed round); the same seed gives the same plan, so a failing chaos run can be
replayed. A worker takes requests through a ``FaultHook``, composed in only when the job
asks for faults inside workers.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diloco.config_base import check

log = logging.getLogger(__name__)

FAULT_KINDS = ("kill", "hang", "break_lane", "nan", "restart_lighthouse")
WORKER_KINDS = ("break_lane", "nan")  # the planned kinds a worker injects itself, at its next round
INJECTABLE_FAULTS = ("fail_round", "break_lane", "nan")  # what a request may ask of a worker
KIND_STAGGER_S = 1.0


@dataclass(frozen=True)
class FaultsConfig:
    """Seconds between faults of each kind (0: never), counted from ``start_after``."""

    seed: int = 0
    start_after: float = 20.0
    stop_after: float = 0.0  # no new faults after this many seconds (0: until the job ends)
    kill_every: float = 0.0
    kill_same_group_twice: bool = False  # False: a kill never hits the group killed just before
    min_alive: int = (
        0  # a kill never leaves fewer other groups holding the job's state: it goes elsewhere or is skipped
    )
    hang_every: float = 0.0
    hang_seconds: float = 5.0
    break_lane_every: float = 0.0
    nan_every: float = 0.0
    restart_lighthouse_every: float = 0.0
    lighthouse_down_seconds: float = 2.0
    accept_requests: bool = False  # workers take faults requested by hand too (LocalCluster.request_fault)
    # A straggler: group slow_group's workers sleep after each inner step, so every step takes
    # slowdown times as long as its compute (heterogeneous hardware; -1: no slow group).
    slow_group: int = -1
    slowdown: float = 1.0

    def validate(self) -> None:
        for key in ("start_after", "stop_after", "kill_every", "hang_every", "break_lane_every", "nan_every"):
            value = getattr(self, key)
            check(value >= 0, f"faults.{key}", value, "must be >= 0 seconds (0 turns it off)")
        check(
            self.restart_lighthouse_every >= 0,
            "faults.restart_lighthouse_every",
            self.restart_lighthouse_every,
            "must be >= 0",
        )
        check(
            not self.stop_after or self.stop_after > self.start_after,
            "faults.stop_after",
            self.stop_after,
            f"must be 0 (until the job ends) or > faults.start_after={self.start_after:g}: no fault could happen",
        )
        check(self.min_alive >= 0, "faults.min_alive", self.min_alive, "must be >= 0 (0: kills are never held back)")
        check(self.slow_group >= -1, "faults.slow_group", self.slow_group, "must be a group id, or -1 for none")
        check(
            self.slowdown >= 1,
            "faults.slowdown",
            self.slowdown,
            "must be >= 1 (2: every inner step takes twice as long)",
        )
        check(self.hang_seconds > 0, "faults.hang_seconds", self.hang_seconds, "must be > 0 seconds")
        check(
            self.lighthouse_down_seconds >= 0,
            "faults.lighthouse_down_seconds",
            self.lighthouse_down_seconds,
            "must be >= 0",
        )

    @property
    def in_workers(self) -> bool:
        """Whether workers watch for fault requests: the plan holds kinds they inject, or requests come by hand."""
        return self.accept_requests or any(self.period(kind) > 0 for kind in WORKER_KINDS)

    def period(self, kind: str) -> float:
        return getattr(self, f"{kind}_every")


def straggler_pace(cfg: FaultsConfig, group: int) -> Callable[[float], None] | None:
    """What the slow group does after each inner step of ``seconds``: sleep (slowdown − 1) times
    as long, so it computes at its own pace and lends the machine to nobody (None elsewhere)."""
    if group != cfg.slow_group or cfg.slowdown == 1:
        return None
    extra = cfg.slowdown - 1
    return lambda seconds: time.sleep(extra * seconds)


@dataclass(frozen=True)
class FaultEvent:
    """Fault ``kind`` at ``at`` seconds after launch, against ``group`` (None: the lighthouse)."""

    at: float
    kind: str
    group: int | None


def plan_faults(cfg: FaultsConfig, groups: int, horizon_s: float) -> list[FaultEvent]:
    """Every fault up to the horizon, in time order; each kind draws groups from its own seeded stream.

    Kinds start staggered by ``KIND_STAGGER_S`` each (kills first), so the first faults of
    different kinds do not land at the same instant.
    """
    if cfg.stop_after > 0:
        horizon_s = min(horizon_s, cfg.stop_after)
    events: list[FaultEvent] = []
    for index, kind in enumerate(FAULT_KINDS):
        period = cfg.period(kind)
        if period <= 0:
            continue
        rng = random.Random(cfg.seed * len(FAULT_KINDS) + index)
        previous: int | None = None
        at = cfg.start_after + index * KIND_STAGGER_S
        while at <= horizon_s:
            group = None
            if kind != "restart_lighthouse":
                choices = list(range(groups))
                if kind == "kill" and not cfg.kill_same_group_twice and previous is not None and groups > 1:
                    choices.remove(previous)
                group = previous = rng.choice(choices)
            events.append(FaultEvent(at=at, kind=kind, group=group))
            at += period
    return sorted(events, key=lambda e: (e.at, FAULT_KINDS.index(e.kind)))


def kill_target(planned: int, up: set[int], holders: set[int], min_alive: int, groups: int) -> int | None:
    """The group a kill hits: the planned one or, failing it, the next one (by id) that is up
    and whose death leaves ``min_alive`` other groups holding the job's state; None if none.

    Groups holding the state come first: killing one tests a recovery, while killing a
    group still taking the state after a restart tests only the restart again. Such a group
    is hit only when no holder may be.
    """
    allowed = [g for g in up if len(holders - {g}) >= min_alive]
    candidates = [g for g in allowed if g in holders] or allowed
    return min(candidates, key=lambda g: (g - planned) % groups, default=None)


def request_fault(path: Path, fault: str) -> None:
    """Queue a fault for a group: one line, one write; its workers pick it up at their next round."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(f"{fault} {time.time()}\n")


class FaultHook:
    """The faults requested for one group, injected by its synchronizer at the next round they apply to.

    ``fail_round``: this worker's all-reduce is treated as failed after it completes (the
    peers commit, this group does not and heals next round). ``break_lane``: the lane is
    aborted while the all-reduce is in flight (nobody commits that round). ``nan``: this
    group's update becomes non-finite (the guard leaves it out; it heals).

    Composed in by the worker only when the job injects faults into workers: without a hook
    the synchronizer reads no file. Every worker of the group reads the same request file,
    polled at the start of each round rather than signalled, so a request can never reach a
    process before it is ready for it. Requests older than ``since`` (when this process of
    the group was started) targeted an earlier process, before a restart.
    """

    def __init__(self, path: Path, *, since: float, group: str) -> None:
        self.path = path
        self.since = since
        self.group = group
        self._seen = 0
        self._pending: set[str] = set()

    def poll(self) -> None:
        """At the start of a round: queue the faults requested since the last poll."""
        lines = self._lines()
        new, self._seen = lines[self._seen :], len(lines)
        for fault, at in (line.split() for line in new):
            if float(at) >= self.since:
                self.inject(fault)

    def inject(self, fault: str) -> None:
        """Queue ``fault`` for the next round it applies to."""
        if fault not in INJECTABLE_FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {', '.join(INJECTABLE_FAULTS)}")
        self._pending.add(fault)

    def take(self, fault: str) -> bool:
        """True once per queued ``fault``: the round asking injects it now."""
        if fault not in self._pending:
            return False
        self._pending.discard(fault)
        log.warning("group %s: injected fault %s", self.group, fault)
        return True

    def _lines(self) -> list[str]:
        try:
            return [line for line in self.path.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []
