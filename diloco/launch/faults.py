"""Deterministic fault injection: which fault hits which group when, as a pure plan.

The ``FaultInjector`` fires the plan against real processes (SIGKILL, SIGSTOP/SIGCONT, a
killed lighthouse, and requests the workers pick up at their next round: a broken lane, a NaN
update, a failed round); the same seed gives the same plan, so a failing chaos run can be
replayed. A worker takes requests through a ``FaultHook`` (diloco/ft/fault_requests.py),
composed in only when the job asks for faults inside workers.
"""

from __future__ import annotations

import logging
import random
import signal
from dataclasses import dataclass

from diloco.config.faults import FaultsConfig
from diloco.launch.local_cluster import LocalCluster
from diloco.launch.supervisor import EventLog, StateHolders

log = logging.getLogger(__name__)

FAULT_KINDS = ("kill", "hang", "break_lane", "nan", "restart_lighthouse")
KIND_STAGGER_S = 1.0


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
    return fault_target(planned, set(candidates), groups)


def fault_target(planned: int, up: set[int], groups: int) -> int | None:
    """The planned group if it is up, else the next one (by id) that is; None if none is."""
    return min(up, key=lambda g: (g - planned) % groups, default=None)


class FaultInjector:
    """Fires a fault plan against the cluster's real processes as time passes.

    A fault whose planned group is down or hung goes to the next group that is up (a kill:
    that can take it without leaving fewer than ``min_alive`` other groups holding the job's
    state), or is skipped if none can, so a plan's fault rates are what the job sees (on a
    loaded machine a launcher late to its first pass fires the first kill, hang and NaN at once:
    the NaN planned for the group just killed goes to another).
    """

    def __init__(
        self,
        cluster: LocalCluster,
        plan: list[FaultEvent],
        events: EventLog,
        *,
        hang_s: float,
        down_s: float,
        min_alive: int = 0,
    ):
        self.cluster = cluster
        self.plan = list(plan)
        self.events = events
        self.hang_s = hang_s
        self.down_s = down_s
        self.min_alive = min_alive
        self.holders = StateHolders(cluster)
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
        up = {g for g in self.cluster.groups if g not in self.resume_at}
        if event.kind == "kill":
            holders = self.holders.current() - set(self.resume_at)
            group = kill_target(event.group, up, holders, self.min_alive, self.cluster.job.cluster.groups)
        else:
            group = fault_target(event.group, up, self.cluster.job.cluster.groups)
        if group is None:
            self.events.write("skipped", event.group, fault=event.kind)  # no group is up (and may take it)
            return
        if event.kind == "kill":
            self.cluster.signal_group(group, signal.SIGKILL)
        elif event.kind == "hang":
            self.cluster.signal_group(group, signal.SIGSTOP)
            self.resume_at[group] = now + self.hang_s
        else:
            self.cluster.request_fault(group, event.kind)
        self.events.write(event.kind, group)
