"""Quorum rules: who takes part in the next outer sync, decided from heartbeats and requests alone.

Pure logic with time passed in, no network: the lighthouse calls it under a lock, and tests
drive it with plain numbers. Symbols follow DESIGN.md section 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.config_base import check


@dataclass(frozen=True)
class QuorumRules:
    """``min_groups`` must ask before any quorum forms; ``join_timeout_s`` is how long the
    first asker waits for the rest; a group silent for ``heartbeat_timeout_s`` is dropped."""

    min_groups: int = 1
    join_timeout_s: float = 5.0
    heartbeat_timeout_s: float = 10.0

    def validate(self) -> None:
        check(self.min_groups >= 1, "cluster.min_groups", self.min_groups, "must be a positive integer")
        check(self.join_timeout_s > 0, "cluster.timeouts.join", self.join_timeout_s, "must be > 0 seconds")
        check(
            self.heartbeat_timeout_s > 0,
            "cluster.timeouts.heartbeat",
            self.heartbeat_timeout_s,
            "must be > 0 seconds",
        )


@dataclass(frozen=True)
class QuorumRequest:
    """A group leader asking to take part in the next sync.

    ``step`` is the group's committed outer step; ``commit_failed`` reports that its last
    round failed, which forces a new quorum id (and so fresh lanes) even if nobody left.
    """

    group: str
    step: int
    commit_failed: bool = False


@dataclass(frozen=True)
class Quorum:
    """The lighthouse's answer, identical for every participant."""

    quorum_id: int
    participants: tuple[str, ...]  # fixed order: a participant's index is its rank in every lane
    max_step: int
    heal_from: dict[str, str]  # group behind max_step (or new) -> the live peer it receives state from
    round_floor: int = 0  # > 0 when the job's newest rounds were lost: a commit here is round_floor + 1

    def rank_of(self, group: str) -> int:
        return self.participants.index(group)

    def to_json(self) -> dict:
        return {
            "quorum_id": self.quorum_id,
            "participants": list(self.participants),
            "max_step": self.max_step,
            "heal_from": dict(self.heal_from),
            "round_floor": self.round_floor,
        }

    @classmethod
    def from_json(cls, data: dict) -> Quorum:
        return cls(
            quorum_id=int(data["quorum_id"]),
            participants=tuple(str(p) for p in data["participants"]),
            max_step=int(data["max_step"]),
            heal_from={str(k): str(v) for k, v in data["heal_from"].items()},
            round_floor=int(data.get("round_floor", 0)),
        )


def healthy_groups(last_heartbeat: dict[str, float], now: float, timeout_s: float) -> set[str]:
    """Groups whose last heartbeat is younger than the timeout."""
    return {g for g, t in last_heartbeat.items() if now - t < timeout_s}


def quorum_ready(
    askers: set[str],
    healthy: set[str],
    previous: tuple[str, ...] | None,
    join_clock_start: float | None,
    now: float,
    rules: QuorumRules,
) -> bool:
    """Whether the askers may form a quorum now.

    Never with fewer than ``min_groups``, and never without a strict majority of the
    heartbeating groups (so two halves of a partitioned job cannot both move on). Then: at
    once when the previous quorum asks again in full (the steady state costs no waiting) or
    every healthy group has asked; otherwise once ``join_timeout`` has passed on the join
    clock (see ``QuorumBook.join_clock_start``).
    """
    if len(askers) < rules.min_groups:
        return False
    if 2 * len(askers & healthy) <= len(healthy):
        return False
    if previous and set(previous) <= askers:
        return True
    if healthy <= askers:
        return True
    return join_clock_start is not None and now - join_clock_start >= rules.join_timeout_s


def assign_healing(steps: dict[str, int]) -> dict[str, str]:
    """Each participant behind the max step -> an up-to-date peer, spread round-robin.

    Both lists are sorted, so every lighthouse restart gives the same assignment for the
    same inputs.
    """
    max_step = max(steps.values())
    sources = sorted(g for g, s in steps.items() if s == max_step)
    behind = sorted(g for g, s in steps.items() if s < max_step)
    return {g: sources[i % len(sources)] for i, g in enumerate(behind)}


def next_quorum_id(previous: Quorum | None, participants: tuple[str, ...], fresh_lanes: bool) -> int:
    """Changes exactly when membership changes or a member needs fresh lanes.

    ``fresh_lanes``: a member reports a failed commit, or comes back behind (it heals, or
    the job goes on from lost state). A member that died and came back between two quorums
    leaves the participants unchanged, yet its old lane is gone: the id must change.
    """
    if previous is None:
        return 1
    if previous.participants != participants or fresh_lanes:
        return previous.quorum_id + 1
    return previous.quorum_id


@dataclass
class QuorumBook:
    """The lighthouse's memory: heartbeats, open requests and the last quorum.

    ``quorum_id_floor`` lets a restarted lighthouse continue above ids the groups have
    already seen (they report theirs in heartbeats), so an id is never reused.
    ``high_water`` is the highest committed step any group has reported: a quorum whose
    members are all below it would fork the job from stale state (nobody could heal them),
    so the askers wait for a live peer that holds the job's state. Only once no healthy
    group has reported that step for ``heartbeat_timeout_s`` is that state taken as lost
    (every holder died before anyone healed from it): the best surviving state goes on, and
    its rounds are numbered above any lost one (``Quorum.round_floor``), so a holder that
    was only stopped and comes back is behind and heals instead of meeting a different
    state under the same round number.
    """

    rules: QuorumRules
    last_heartbeat: dict[str, float] = field(default_factory=dict)
    pending: dict[str, QuorumRequest] = field(default_factory=dict)
    asked_at: dict[str, float] = field(default_factory=dict)
    previous: Quorum | None = None
    quorum_id_floor: int = 0
    high_water: int = 0
    reported: dict[str, int] = field(default_factory=dict)  # each group's last reported committed step
    lost_since: float | None = None

    def heartbeat(self, group: str, now: float, quorum_id_seen: int = 0, step: int | None = None) -> None:
        self.last_heartbeat[group] = now
        self.quorum_id_floor = max(self.quorum_id_floor, quorum_id_seen)
        if step is not None:
            self.reported[group] = step
            self.high_water = max(self.high_water, step)

    def ask(self, request: QuorumRequest, now: float) -> None:
        """Register (or refresh) a request; asking is also a heartbeat."""
        self.heartbeat(request.group, now, step=request.step)
        self.pending[request.group] = request
        self.asked_at.setdefault(request.group, now)

    def withdraw(self, group: str) -> None:
        """Drop an open request whose caller gave up waiting."""
        self.pending.pop(group, None)
        self.asked_at.pop(group, None)

    def healthy(self, now: float) -> set[str]:
        return healthy_groups(self.last_heartbeat, now, self.rules.heartbeat_timeout_s)

    def join_clock_start(self) -> float | None:
        """When the join timeout starts counting: the first ask of a member of the previous quorum.

        A newcomer asking between rounds must not start it: its old request would let the
        next round form the moment a majority asks, leaving out members about to ask.
        """
        members = set(self.previous.participants) if self.previous else set(self.pending)
        times = [t for g, t in self.asked_at.items() if g in members]
        return min(times) if times else None

    def decide(self, now: float) -> Quorum | None:
        """Form a quorum from the open requests if the rules allow it, and close them."""
        healthy = self.healthy(now)
        for group in [g for g in self.pending if g not in healthy]:
            self.withdraw(group)  # an asker that stopped heartbeating is not waited for
        askers = set(self.pending)
        previous = self.previous.participants if self.previous else None
        if not quorum_ready(askers, healthy, previous, self.join_clock_start(), now, self.rules):
            return None
        participants = tuple(sorted(askers))
        steps = {g: self.pending[g].step for g in participants}
        round_floor = 0
        if max(steps.values()) < self.high_water:
            if not self._newest_state_lost(healthy, now):
                return None
            # One above: a group may have committed one round past the last step it reported.
            round_floor = self.high_water + 1
        heal_from = assign_healing(steps)
        fresh_lanes = bool(heal_from) or round_floor > 0 or any(r.commit_failed for r in self.pending.values())
        quorum_id = next_quorum_id(self.previous, participants, fresh_lanes)
        if self.previous is None or quorum_id != self.previous.quorum_id:
            quorum_id = max(quorum_id, self.quorum_id_floor + 1)
        quorum = Quorum(quorum_id, participants, max(steps.values()), heal_from, round_floor)
        self.previous = quorum
        self.lost_since = None
        self.pending.clear()
        self.asked_at.clear()
        return quorum

    def _newest_state_lost(self, healthy: set[str], now: float) -> bool:
        """True once no healthy group has reported ``high_water`` for ``heartbeat_timeout_s``."""
        if any(self.reported.get(g, 0) >= self.high_water for g in healthy):
            self.lost_since = None
            return False
        self.lost_since = self.lost_since if self.lost_since is not None else now
        return now - self.lost_since >= self.rules.heartbeat_timeout_s
