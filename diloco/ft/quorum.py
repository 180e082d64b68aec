"""Quorum rules: who takes part in the next outer sync, decided from heartbeats and requests alone.

Pure logic with time passed in, no network: the lighthouse calls it under a lock, and tests
drive it with plain numbers. The rules, in words: docs/fault-tolerance.md, "The lighthouse and quorums".
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from diloco.config.cluster import QuorumRules
from diloco.ft.reachability import Reachability, largest_reachable_set

SKEW_MARGIN = 3.0  # a round waits this many times the latest recent ask (30 groups on 2 cores: spikes of 2.5x)
SKEW_ROUNDS = 10  # how many recent rounds' ask skews the join wait remembers
BROKEN_KEPT = 1024  # broken rounds remembered, so a member that comes back late still learns its round broke
SIT_OUT_AFTER = 2  # rounds failed in a row before a group sits out (see QuorumBook.sit_out)
SIT_OUT_DOUBLINGS = 3  # a group that sits out again and again does so for at most 2**3 times the period
LANE_FAILED = "it gave the round up: its lane failed (cluster.timeouts.collective, or .connect while forming)"


@dataclass(frozen=True)
class QuorumRequest:
    """A group leader asking to take part in the next sync.

    ``step`` is the group's committed outer step; ``round_step`` the inner step it asks
    at (the round's launch step, which fixes the fragments it will reduce): groups that
    missed different numbers of windows without a quorum (a lighthouse outage) hold the
    same committed state at different inner steps, and only groups at the same
    ``(step, round_step)`` reduce together. ``commit_failed`` reports that its last
    round failed, which forces a new quorum id (and so fresh lanes) even if nobody left;
    ``lane_failed`` that it failed on the lane itself (a rendezvous or an all-reduce that timed
    out or lost a peer), not on a non-finite update or a member that left (``QuorumBook.sit_out``).
    A ``finished`` group has trained to the end: it asks only to serve its state to groups
    that are behind (or to take it, if it is behind itself) until the job ends; ``digest``
    is then the digest of its global state.
    """

    group: str
    step: int
    commit_failed: bool = False
    finished: bool = False
    digest: str = ""
    round_step: int = 0
    lane_failed: bool = False

    @property
    def position(self) -> tuple[int, int]:
        """How far the group is: committed rounds first, then inner steps since."""
        return (self.step, self.round_step)


@dataclass(frozen=True)
class Quorum:
    """The lighthouse's answer, identical for every participant."""

    quorum_id: int
    participants: tuple[str, ...]  # fixed order: a participant's index is its rank in every lane
    max_step: int
    heal_from: dict[str, str]  # group behind max_step (or new) -> the live peer it receives state from
    round_floor: int = 0  # > 0 when the job's newest rounds were lost: a commit here is round_floor + 1
    closing: bool = False  # finished groups hand their final state to those behind: nothing is reduced or committed
    # Which formation this is: the id stays while membership holds, a round is formed anew each time.
    round_id: int = 0
    # Participant -> "host:port" of its probe listener (diloco.ft.reach), for those that have one.
    endpoints: dict[str, str] = field(default_factory=dict)

    def rank_of(self, group: str) -> int:
        return self.participants.index(group)

    def to_json(self) -> dict:
        return {
            "quorum_id": self.quorum_id,
            "participants": list(self.participants),
            "max_step": self.max_step,
            "heal_from": dict(self.heal_from),
            "round_floor": self.round_floor,
            "closing": self.closing,
            "round_id": self.round_id,
            "endpoints": dict(self.endpoints),
        }

    @classmethod
    def from_json(cls, data: dict) -> Quorum:
        return cls(
            quorum_id=int(data["quorum_id"]),
            participants=tuple(str(p) for p in data["participants"]),
            max_step=int(data["max_step"]),
            heal_from={str(k): str(v) for k, v in data["heal_from"].items()},
            round_floor=int(data.get("round_floor", 0)),
            closing=bool(data.get("closing", False)),
            round_id=int(data.get("round_id", 0)),
            endpoints={str(k): str(v) for k, v in data.get("endpoints", {}).items()},
        )


@dataclass(frozen=True)
class JobEnd:
    """The job is over: every group finished (or ``end_timeout_s`` passed); the final state is ``round``.

    ``digest`` is the final global state's digest; ``holders`` are the finished groups that
    reported exactly that state at the end. Every holder saves the final model, so it is
    saved even if some of them die in the second after the end, and a holder that dies
    before writing its result still counts as a group that ended holding the job's model.
    """

    round: int
    digest: str
    holders: tuple[str, ...]

    def to_json(self) -> dict:
        return {"round": self.round, "digest": self.digest, "holders": list(self.holders)}

    @classmethod
    def from_json(cls, data: dict) -> JobEnd:
        return cls(round=int(data["round"]), digest=str(data["digest"]), holders=tuple(map(str, data["holders"])))


@dataclass(frozen=True)
class RoundBreak:
    """How a round broke: why (its first member to leave), and every member that left it."""

    reason: str
    gone: frozenset[str]
    left: bool = True  # a member left it (died, went silent), not only gave it up on a failed lane


def healthy_groups(last_heartbeat: dict[str, float], now: float, timeout_s: float) -> set[str]:
    """Groups whose last heartbeat is younger than the timeout."""
    return {g for g, t in last_heartbeat.items() if now - t < timeout_s}


def join_wait(skews: Sequence[float] | None, rules: QuorumRules) -> float:
    """How long a round waits on the join clock for healthy groups that have not asked yet.

    ``skews``: for each recent round, how long after its join clock started its last
    in-step group asked (counting a group that asked only after the round had closed
    without it). The wait is ``SKEW_MARGIN`` times the largest, never below
    ``join_timeout_s`` and, above that, never beyond ``heartbeat_timeout_s``: a group that
    is truly dead stops heartbeating within that time anyway, and a hung one that still
    heartbeats never asks, so it adds nothing to the measured skew and costs each round at
    most this wait. ``None``: a job's first round after its start, whose skew is not known
    yet (the start's is the groups' start-up, not their training): the wait is that bound,
    as guessing short leaves the slower half of a busy machine out of it.
    """
    if skews is None:
        return max(rules.join_timeout_s, rules.heartbeat_timeout_s)
    measured = min(SKEW_MARGIN * max(skews, default=0.0), rules.heartbeat_timeout_s)
    return max(rules.join_timeout_s, measured)


def quorum_ready(
    askers: set[str],
    healthy: set[str],
    previous: tuple[str, ...] | None,
    join_clock_start: float | None,
    now: float,
    rules: QuorumRules,
    wait_s: float | None = None,
) -> bool:
    """Whether the askers may form a quorum now.

    Never with fewer than ``min_groups``, and never without a strict majority of the
    heartbeating groups (so two halves of a partitioned job cannot both move on). Then: at
    once when the previous quorum asks again in full (the steady state costs no waiting) or
    every healthy group has asked; otherwise once ``wait_s`` (``join_wait``; by default
    ``join_timeout``) has passed on the join clock (see ``QuorumBook.join_clock_start``).
    """
    if len(askers) < rules.min_groups:
        return False
    if 2 * len(askers & healthy) <= len(healthy):
        return False
    if previous and set(previous) <= askers:
        return True
    if healthy <= askers:
        return True
    wait_s = rules.join_timeout_s if wait_s is None else wait_s
    return join_clock_start is not None and now - join_clock_start >= wait_s


def assign_healing(positions: dict[str, tuple[int, int]]) -> dict[str, str]:
    """Each participant behind the furthest position -> a peer at it, spread round-robin.

    A position is ``QuorumRequest.position``. Both lists are sorted, so every lighthouse
    restart gives the same assignment for the same inputs.
    """
    furthest = max(positions.values())
    sources = sorted(g for g, p in positions.items() if p == furthest)
    behind = sorted(g for g, p in positions.items() if p < furthest)
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
    """The lighthouse's memory: heartbeats, open requests, the last quorum and the job's end.

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

    Start: a fresh job's first quorum waits for every expected group (up to
    ``start_timeout_s``); a lighthouse restarted mid-job (groups report quorum ids it never
    issued) forms nothing until it has heard from every expected group or a heartbeat
    timeout has passed, so no quorum forms before the holders of the newest state speak.

    End: a group that trained to the end reports itself finished and stays. While a healthy
    finished group holds the job's newest state, quorums are closing ones: finished holders of
    the job's state hand it to the askers behind it and nothing new is committed, so no group
    commits from stale state after its peers finished (``_closing``). The job ends once every expected group has
    finished at one step, or ``end_timeout_s`` after the first group finished.
    """

    rules: QuorumRules
    started_at: float = 0.0
    last_heartbeat: dict[str, float] = field(default_factory=dict)
    pending: dict[str, QuorumRequest] = field(default_factory=dict)
    asked_at: dict[str, float] = field(default_factory=dict)
    previous: Quorum | None = None
    quorum_id_floor: int = 0
    high_water: int = 0
    reported: dict[str, int] = field(default_factory=dict)  # each group's last reported committed step
    lost_since: float | None = None
    first_seen_at: float | None = None
    finished: dict[str, tuple[int, str]] = field(default_factory=dict)  # group -> (step, digest) it finished at
    finished_at: dict[str, float] = field(default_factory=dict)  # group -> when it said it finished
    ended: JobEnd | None = None
    turned_away: dict[str, str] = field(default_factory=dict)  # withdrawn requests -> why (answered at once)
    awaited: dict[str, tuple[float, float]] = field(default_factory=dict)  # restarting group -> (since, until)
    # Recent rounds' ask skews, newest last; None right after a job's start (see join_wait).
    ask_skew: list[float] | None = field(default_factory=list)
    last_round: tuple[tuple[int, int], float] | None = None  # the last round's position and join clock start
    _healthy_at: tuple[float, frozenset[str]] | None = field(default=None, repr=False, compare=False)  # healthy()
    rounds_formed: int = 0
    # Round id -> its members that have not asked again since (see ``break_rounds``).
    open_rounds: dict[int, set[str]] = field(default_factory=dict)
    broken: dict[int, RoundBreak] = field(default_factory=dict)  # the rounds members left (see break_rounds)
    granted_round: dict[str, int] = field(default_factory=dict)  # group -> the last round it was granted
    failed_in_a_row: int = 0  # training rounds whose members all came back saying it failed (see sit_out)
    failures_counted_at: int = 0  # the round whose outcome failed_in_a_row last counted
    sitting_out: dict[str, float] = field(default_factory=dict)  # group -> until when it sits out
    # Round -> its members that gave it up -> why: back saying its lane failed, or found cut from a member.
    gave_up: dict[int, dict[str, str]] = field(default_factory=dict)
    sat_out: dict[str, int] = field(default_factory=dict)  # group -> times it sat out since a round with it worked
    reach: Reachability = field(init=False)  # who reaches whom, from the leaders' probes (see decide)
    formed_at: deque[float] = field(default_factory=lambda: deque(maxlen=SKEW_ROUNDS))  # training rounds' times

    def __post_init__(self) -> None:
        self.reach = Reachability(hold_s=self.rules.sit_out_s)

    def give_up_cut_rounds(self, group: str, now: float) -> bool:
        """``group`` gives up its open round if it is cut from a member of it (its probe before the
        round's lane formed found so): the lane could never form, so the others stop waiting for
        it at once (``break_rounds``), and all of them ask again at their next sync. True if it did."""
        round_id = self.granted_round.get(group, 0)
        members = self.open_rounds.get(round_id, set())
        cut = sorted(g for g in members if g != group and self.reach.is_cut(group, g, now))
        if group in members and cut:
            self.gave_up.setdefault(round_id, {})[group] = f"it cannot reach {', '.join(cut)} (its probes)"
            return True
        return False

    def reach_report(
        self,
        group: str,
        host: str,
        port: int,
        reached: dict[str, str],
        unreached: dict[str, str],
        now: float,
        mbps: dict[str, float] | None = None,
        round_bytes: int = 0,
    ) -> None:
        """A leader's probe endpoint (``host`` as the lighthouse sees it, ``port`` 0: none), its
        probes, the throughput of the links it timed and what its lane carried in its last round."""
        if port:
            self.reach.register(group, f"{host}:{port}")
        self.reach.report(group, reached, unreached, now, mbps)
        if round_bytes:
            self.reach.round_bytes[group] = round_bytes

    def heartbeat(
        self, group: str, now: float, quorum_id_seen: int = 0, step: int | None = None, finished: bool = False
    ) -> None:
        """A sign of life; a group that says it is not finished (a new process of it) trains again."""
        self.first_seen_at = now if self.first_seen_at is None else self.first_seen_at
        self.last_heartbeat[group] = now
        self._healthy_at = None
        self.quorum_id_floor = max(self.quorum_id_floor, quorum_id_seen)
        if step is not None:
            self.reported[group] = step
            self.high_water = max(self.high_water, step)
        if not finished:
            self.finished.pop(group, None)
            self.finished_at.pop(group, None)

    def ask(self, request: QuorumRequest, now: float) -> None:
        """Register (or refresh) a request; asking is also a heartbeat."""
        self.heartbeat(request.group, now, step=request.step, finished=request.finished)
        if request.finished:
            self.finished[request.group] = (request.step, request.digest)
            self.finished_at.setdefault(request.group, now)
        self.turned_away.pop(request.group, None)
        self.awaited.pop(request.group, None)
        round_id = self.granted_round.get(request.group, 0)
        if request.lane_failed and len(self.open_rounds.get(round_id, ())) > 1:  # others still wait in it
            self.gave_up.setdefault(round_id, {})[request.group] = LANE_FAILED
        self.leave_rounds(request.group)
        if request.group not in self.pending and self.last_round is not None and self.ask_skew:
            position, clock_start = self.last_round
            if request.position == position:  # it asked for a round that closed without it: too late by this much
                self.ask_skew[-1] = max(self.ask_skew[-1], now - clock_start)
        self.pending[request.group] = request
        self.asked_at.setdefault(request.group, now)

    def everyone_asked(self) -> bool:
        """Every group heard from has an open request: a round may form now (a hint, counted in O(1))."""
        return len(self.pending) >= len(self.last_heartbeat)

    def await_return(self, group: str, now: float, wait_s: float) -> None:
        """A dead group is being replaced: hold rounds for its replacement up to ``wait_s``; then go on without it."""
        self.awaited[group] = (now, now + wait_s)

    def depart(self, group: str) -> None:
        """A dead group left: rounds stop waiting for it at once; its replacement's heartbeats bring it back."""
        self.last_heartbeat.pop(group, None)
        self._healthy_at = None
        self.awaited.pop(group, None)
        self.reach.forget(group)
        self.withdraw(group)

    def withdraw(self, group: str) -> None:
        """Drop an open request whose caller gave up waiting."""
        self.pending.pop(group, None)
        self.asked_at.pop(group, None)

    def leave_rounds(self, group: str) -> None:
        """``group`` is done with its open round (it asks again): a later silence breaks no round."""
        for round_id, members in list(self.open_rounds.items()):
            members.discard(group)
            if not members:
                del self.open_rounds[round_id]

    def break_rounds(self, now: float) -> dict[str, str]:
        """Mark every open round a member left (silent for ``heartbeat_timeout_s``, or departed)
        or gave up (it asked again saying the round's lane failed) as broken by it; returns, for
        each group still in such a round, why.

        A hung peer (SIGSTOP, a stuck GPU) keeps the others' all-reduce or heal with it waiting
        until ``timeouts.collective``; the lighthouse stops hearing it after
        ``heartbeat_timeout_s``. The members still in the round give up what they wait on with
        the gone (``RoundBreak.gone``): its all-reduce, and transfers with a gone peer (a heal
        between two others goes on). The gone stay gone: a member that resumes later may not
        commit the round (``commit``), so it cannot hold a state nobody else has under the
        same round number.

        A member gives a round up when its own wait on the lane ran out (two hosts that cannot
        reach each other: one side's all-reduce times out while the other still waits for its
        lane to form, up to ``timeouts.connect``): the others stop waiting for it at once.
        """
        healthy, told = self.healthy(now), {}
        for round_id in [r for r in self.gave_up if r not in self.open_rounds]:  # closed meanwhile
            del self.gave_up[round_id]
        for round_id, members in list(self.open_rounds.items()):
            gone, given_up = members - healthy, self.gave_up.pop(round_id, {})
            if not gone and not given_up:
                continue
            if gone:
                first = min(gone)
                why = (
                    "it departed (its process died)"
                    if first not in self.last_heartbeat
                    else f"no heartbeat for cluster.timeouts.heartbeat={self.rules.heartbeat_timeout_s:g} s"
                )
            else:
                first = min(given_up)
                why = given_up[first]
            earlier = self.broken.get(round_id)
            self.broken[round_id] = RoundBreak(
                earlier.reason if earlier else f"group {first} left round {round_id}: {why}",
                (earlier.gone if earlier else frozenset()) | gone | given_up.keys(),
                (earlier is not None and earlier.left) or bool(gone),
            )
            told.update(dict.fromkeys(members, self.broken[round_id].reason))
            members -= gone
            if not members:
                del self.open_rounds[round_id]
        while len(self.broken) > BROKEN_KEPT:
            del self.broken[next(iter(self.broken))]
        return told

    def watched_round(self, group: str) -> tuple[int, RoundBreak | None]:
        """The round a lane watch of ``group`` follows, the last one granted to it here (a watch is
        held across rounds; the round a worker names may be a restarted lighthouse's), and how it
        broke, if it did; 0 before any."""
        round_id = self.granted_round.get(group, 0)
        return round_id, self.broken.get(round_id)

    def commit(self, group: str, round_id: int, step: int, now: float) -> str:
        """``group`` commits round ``round_id`` at committed ``step``: "" when it may (the step is
        recorded at once, so a quorum formed next heals whoever is behind it), else why not.
        Either way it is a heartbeat (``LighthouseClient.beat_due_in``).

        Refused to a member that left the round (the others gave up what they waited on with
        it), and for a round unknown here (a restarted lighthouse formed no such round: every
        member's commit is refused, and they go on, equal, from the round before). A member
        still in a broken round whose all-reduce completed commits: whoever gave it up is
        behind, and heals.
        """
        broken = self.broken.get(round_id)
        if broken is not None and group in broken.gone:
            reason = broken.reason
        elif group not in self.open_rounds.get(round_id, ()):
            reason = f"round {round_id} is not open for group {group} at this lighthouse (was it restarted?)"
        else:
            reason = ""  # it stays in the round (a flight commits each fragment) until it asks
        self.heartbeat(group, now, step=None if reason else step)  # a sign of life, allowed or not
        return reason

    def open_round(self, group: str, position: tuple[int, int]) -> int:
        """The inner step of the round other groups are waiting in, if it lies past ``position``; else 0.

        For time-bounded windows: a slower group learns the round its peers opened and skips
        to it. Only the requests of unfinished groups ahead of ``position`` count (a finished
        group's closing round is no window end); the asker judges whether the step is its next
        round (a ``position`` read before its own last commit still sees its peers' next round).
        """
        ahead = [
            r.round_step for g, r in self.pending.items() if g != group and not r.finished and r.position > position
        ]
        return max(ahead, default=0)

    def healthy(self, now: float) -> frozenset[str]:
        """The healthy groups at ``now``, computed once per moment: one decision asks several times, and
        each is a pass over every group (at 1,000 groups, most of a decision's time)."""
        if self._healthy_at is None or self._healthy_at[0] != now:
            self._healthy_at = (
                now,
                frozenset(healthy_groups(self.last_heartbeat, now, self.rules.heartbeat_timeout_s)),
            )
        return self._healthy_at[1]

    def join_clock_start(self) -> float | None:
        """When the join timeout starts counting: the first ask of a member of the previous quorum
        at the furthest position such a member asks at.

        Neither a newcomer asking between rounds nor a member's new process asking at once to
        heal (behind) may start it: their early requests would let the next round form the
        moment a majority asks, leaving out members about to ask (a round of 627 of 1,000
        groups after a death, in experiments/scale/lighthouse_scale.py).
        """
        members = set(self.previous.participants) if self.previous else set(self.pending)
        asks = [(self.pending[g].position, t) for g, t in self.asked_at.items() if g in members]
        if not asks:
            return None
        furthest = max(position for position, _ in asks)
        return min(t for position, t in asks if position == furthest)

    def join_wait(self) -> float:
        """How long the next round waits for healthy groups that have not asked (see ``join_wait``)."""
        return join_wait(self.ask_skew, self.rules)

    def decide(self, now: float) -> Quorum | None:
        """Form a quorum from the open requests if the rules allow it, and close them.

        Requests the rules will not serve are withdrawn into ``turned_away`` with the reason.
        """
        healthy = self.healthy(now)
        hb = self.rules.heartbeat_timeout_s
        for group in [g for g in self.pending if g not in healthy]:  # an asker that stopped heartbeating
            self._turn_away(group, f"no heartbeat for cluster.timeouts.heartbeat={hb:g} s while it waited")
        if self.ended is not None or not self._started(now):
            return None
        finished = [g for g in self.finished if g in healthy]  # few finish: not a pass over every group
        if finished and self._closing(finished, healthy, now):
            return self._closing_quorum(healthy, now)
        if self._awaiting(now):
            return None
        self._keep_sitting_out(now)
        training = healthy - self.sitting_out.keys() - self.finished.keys()
        taking_part = self._without_slow_links(self._reachable_part(training, now), now)
        askers = set(self.pending) - self.finished.keys()
        previous = self.previous.participants if self.previous else None
        clock_start = self.join_clock_start()
        if not quorum_ready(askers, taking_part, previous, clock_start, now, self.rules, self.join_wait()):
            return None
        participants = self.sit_out(tuple(sorted(askers)), now)
        if len(participants) < self.rules.min_groups:
            return None
        steps = {g: self.pending[g].step for g in participants}
        round_floor = 0
        if max(steps.values()) < self.high_water:
            if not self._newest_state_lost(healthy, now):
                return None
            # One above: a group may have committed one round past the last step it reported.
            round_floor = self.high_water + 1
        heal_from = assign_healing({g: self.pending[g].position for g in participants})
        if previous is None:  # this book's first round: its skew is the start's, not a training round's
            self.ask_skew = None if self.rules.expected_groups and not self.quorum_id_floor else []
        elif clock_start is not None:
            self._measure_skew(participants, clock_start)
        fresh_lanes = bool(heal_from) or round_floor > 0 or any(r.commit_failed for r in self.pending.values())
        self.formed_at.append(now)
        return self._form(participants, steps, heal_from, fresh_lanes, round_floor=round_floor)

    def _reachable_part(self, taking_part: frozenset[str], now: float) -> frozenset[str]:
        """The largest set of ``taking_part`` whose groups all reach each other (``largest_reachable_set``);
        the askers left out are turned away, saying which peers they cannot reach.

        Only they wait: the quorum's majority is counted among the groups that can meet, so a cut
        pair costs the job the smaller side of it, never a round, and no group outside the pair sits out.
        """
        cuts = self.reach.cuts(taking_part, now)
        if not cuts:
            return taking_part
        chosen = largest_reachable_set(taking_part, cuts, self._position)
        for group in [g for g in self.pending if g in taking_part and g not in chosen]:
            unreached = ", ".join(g for g in self.reach.unreached_by(group, now) if g in chosen) or "the others"
            self._turn_away(
                group,
                f"it cannot reach {unreached} (its probes or theirs, cluster.timeouts.probe): groups "
                f"{', '.join(sorted(chosen))} train on; it trains apart and heals once its link is back",
            )
        return chosen

    def _without_slow_links(self, taking_part: frozenset[str], now: float) -> frozenset[str]:
        """``taking_part`` less the groups whose link is too slow for the others' rounds
        (``Reachability.slow_links``), whose asks are turned away with the measurement."""
        slow = self.reach.slow_links(taking_part, self.rules.slow_link_factor, self._round_interval(), now)
        for group in [g for g in self.pending if g in slow]:
            mbps, median = slow[group]
            self._turn_away(
                group,
                f"its link was timed at {mbps:.3g} Mbit/s against the others' median {median:.3g} "
                f"(cluster.slow_link_factor={self.rules.slow_link_factor:g}): every round with it would move "
                "at its pace; it trains apart and heals once its link is timed faster",
            )
        return taking_part - slow.keys()

    def _round_interval(self) -> float:
        """The median time between the last training rounds formed (0 before two): what a slow link's
        extra time per round is weighed against."""
        gaps = [b - a for a, b in itertools.pairwise(self.formed_at)]
        return statistics.median(gaps) if gaps else 0.0

    def _position(self, group: str) -> tuple[int, int]:
        """What ranks a group's state in ``largest_reachable_set``: its committed round, then whether
        it was in the last quorum. Not its inner step: asking, or between two asks, must not flip
        which side of a cut trains (each flip throws one side's work away)."""
        request = self.pending.get(group)
        step = max(self.reported.get(group, 0), request.step if request is not None else 0)
        return (step, int(self.previous is not None and group in self.previous.participants))

    def end_of_job(self, now: float) -> JobEnd | None:
        """The job's end, once every expected group finished at one step or ``end_timeout_s`` passed
        since the first group finished at the highest step any finished group holds.

        Then the final state is the one at that step (the first such group's, by id: a committed
        round has one state); groups that never caught up are left behind. Never while a healthy
        unfinished group holds a newer state than every finished one: a group that trained to its
        end apart (cut off, or sitting out) and finished first must not end the job with its older
        state.
        """
        if self.ended is not None:
            return self.ended
        healthy = self.healthy(now)
        finished = {g: v for g, v in self.finished.items() if g in healthy}
        if not finished:
            return None
        top = max(step for step, _ in finished.values())
        if any(self.reported.get(g, 0) > top for g in healthy - finished.keys()):
            return None  # that group trains on to its end, then finishes (or dies) with the newer state
        level = all(step == top for step, _ in finished.values())
        everyone = healthy <= finished.keys() and len(finished) >= self.rules.expected_groups
        since = min(self.finished_at.get(g, now) for g, (step, _) in finished.items() if step == top)
        if not (level and everyone) and now - since < self.rules.end_timeout_s:
            return None
        digest = finished[min(g for g, (step, _) in finished.items() if step == top)][1]
        holders = tuple(sorted(g for g, held in finished.items() if held == (top, digest)))
        self.ended = JobEnd(round=top, digest=digest, holders=holders)
        return self.ended

    def _started(self, now: float) -> bool:
        """Whether quorums may form yet (see the class docstring: start, and a restarted lighthouse)."""
        expected = self.rules.expected_groups
        if self.previous is not None or expected == 0:
            return True
        if self.first_seen_at is None:
            return False
        if self.quorum_id_floor == 0:  # a fresh job: its first quorum waits for every group
            return len(self.pending) >= expected or now - self.first_seen_at >= self.rules.start_timeout_s
        return len(self.last_heartbeat) >= expected or now - self.started_at >= self.rules.heartbeat_timeout_s

    def _closing(self, finished: list[str], healthy: frozenset[str], now: float) -> bool:
        """Whether only closing rounds form: a finished group holds the job's newest state (or it was
        lost). Groups that finished apart and behind (cut off, sitting out, on a slow link) hold up no
        one: the others train on in rounds of their own, and the finished wait for their final state."""
        top = max(self.finished[g][0] for g in finished)
        return top >= self.high_water or self._newest_state_lost(healthy, now)

    def _closing_quorum(self, healthy: set[str], now: float) -> Quorum | None:
        """Finished holders of the job's state hand it to every asker behind it."""
        finished = {g: step for g, (step, _) in self.finished.items() if g in healthy}
        top = max(finished.values())
        if top < self.high_water and not self._newest_state_lost(healthy, now):
            return None  # a group that holds newer state is alive: wait for it to finish
        for group in [g for g, r in self.pending.items() if g not in finished and r.step >= top]:
            self._turn_away(group, "other groups have finished training; no new round starts, train on to the end")
        holders = [g for g in self.pending if finished.get(g) == top]
        behind = [g for g, r in self.pending.items() if r.step < top]
        if not holders or not behind:
            return None
        members = self._reachable_part(frozenset(holders + behind), now)  # a lane needs every pair to meet
        holders, behind = [g for g in holders if g in members], [g for g in behind if g in members]
        if not holders or not behind:
            return None
        participants = tuple(sorted(holders + behind))
        steps = {g: self.pending[g].step for g in participants}
        # Finished holders serve whatever inner step they stopped at.
        heal_from = assign_healing({g: (steps[g], 0) for g in participants})
        return self._form(participants, steps, heal_from, fresh_lanes=True, closing=True)

    def _form(
        self,
        participants: tuple[str, ...],
        steps: dict[str, int],
        heal_from: dict[str, str],
        fresh_lanes: bool,
        *,
        round_floor: int = 0,
        closing: bool = False,
    ) -> Quorum:
        quorum_id = next_quorum_id(self.previous, participants, fresh_lanes)
        if self.previous is None or quorum_id != self.previous.quorum_id:
            quorum_id = max(quorum_id, self.quorum_id_floor + 1)
        self.rounds_formed += 1
        endpoints = {g: self.reach.endpoints[g] for g in participants if g in self.reach.endpoints}
        quorum = Quorum(
            quorum_id, participants, max(steps.values()), heal_from, round_floor, closing, self.rounds_formed, endpoints
        )
        self.open_rounds[self.rounds_formed] = set(participants)
        self.previous = quorum
        self.lost_since = None
        for group in participants:
            self.withdraw(group)
            self.granted_round[group] = self.rounds_formed
        return quorum

    def sit_out(self, askers: tuple[str, ...], now: float) -> tuple[str, ...]:
        """The askers who take part in the next round: all of them, unless rounds keep failing.

        A round fails for every member when two of them cannot reach each other while both reach
        the lighthouse (a partition between two hosts), or a member's link is too slow for the
        collective timeout: nobody dies, so the same members would meet, and fail, forever. A cut
        the leaders' probes found is handled by ``decide`` (the largest reachable set) and a slow
        link they timed by ``_without_slow_links``; this is for failures no probe explains (a cut
        between two hosts other than the leaders'). Once ``SIT_OUT_AFTER`` training rounds in a
        row failed on the lane for every member that asks again (each says so,
        ``QuorumRequest.lane_failed``, or one gave the round up and the others were told to), no
        member left them (``break_rounds``) and no cut among them explains them, one asker sits
        out: the one that sat out most
        since a round with it last worked (it came back and rounds failed again: then one failed
        round is enough), else the last by name. It trains on alone and heals when it returns
        after ``sit_out_s``, doubled for each time it sat out since. Each further failure sets
        out one more, never the last asker, so a pair that cannot meet ends up apart and the
        others go on.
        """
        previous = self.previous
        if previous is not None and not previous.closing and previous.round_id != self.failures_counted_at:
            self.failures_counted_at = previous.round_id  # once per round, however often a decision is tried
            back = [g for g in askers if g in previous.participants]
            # A round a member left (it died, went silent) failed for a reason the lighthouse knows.
            broken = self.broken.get(previous.round_id)
            lane_failed = broken is not None or all(self.pending[g].lane_failed for g in back)
            # A cut the probes found explains it: the largest reachable set takes care of it (decide).
            explained = bool(self.reach.cuts(previous.participants, now))
            failed = bool(back) and lane_failed and not (broken and broken.left) and not explained
            self.failed_in_a_row = self.failed_in_a_row + 1 if failed else 0
            if not failed:
                for group in back:
                    self.sat_out.pop(group, None)
        candidates = [g for g in askers if g not in self.finished]
        returned = any(self.sat_out.get(g) for g in candidates)  # one failure is enough with a suspect back
        if self.failed_in_a_row < (1 if returned else SIT_OUT_AFTER) or len(askers) < 2 or not candidates:
            return askers
        group = max(candidates, key=lambda g: (self.sat_out.get(g, 0), g))
        times = self.sat_out[group] = self.sat_out.get(group, 0) + 1
        period = self.rules.sit_out_s * 2 ** min(times - 1, SIT_OUT_DOUBLINGS)
        self.sitting_out[group] = now + period
        self._turn_away(
            group,
            f"sits out rounds for {period:g} s (cluster.timeouts.sit_out): the last {self.failed_in_a_row} "
            "rounds failed for every member (can it reach every other group?); train on, it heals when back",
        )
        return tuple(g for g in askers if g != group)

    def _keep_sitting_out(self, now: float) -> None:
        """Turn away the asks of groups sitting out (``sit_out``); those whose time is up take part again."""
        for group, until in list(self.sitting_out.items()):
            if now >= until:
                del self.sitting_out[group]
            elif group in self.pending:
                self._turn_away(group, f"sits out rounds for {until - now:.0f} s more (cluster.timeouts.sit_out)")

    def _measure_skew(self, participants: tuple[str, ...], clock_start: float) -> None:
        """Remember how long after the join clock started the round's in-step askers asked.

        Only the groups at the round's furthest position count (those behind, healing or
        newly joined, asked for another round); a group that asks for this round after it
        closed raises the figure in ``ask``.
        """
        position = max(self.pending[g].position for g in participants)
        skew = max(self.asked_at[g] - clock_start for g in participants if self.pending[g].position == position)
        self.ask_skew = [*(self.ask_skew or []), max(skew, 0.0)][-SKEW_ROUNDS:]
        self.last_round = (position, clock_start)

    def _awaiting(self, now: float) -> bool:
        """Whether a replacement the launcher announced may still come in time to join the next round.

        Past its deadline a replacement with no sign of life since its group died is given up
        (the group departs), so the survivors' stall stays within the announced wait.
        """
        for group, (since, until) in list(self.awaited.items()):
            if now >= until:
                del self.awaited[group]
                if self.last_heartbeat.get(group, since) <= since:
                    self.depart(group)
        return bool(self.awaited)

    def _turn_away(self, group: str, reason: str) -> None:
        self.withdraw(group)
        self.turned_away[group] = reason

    def _newest_state_lost(self, healthy: set[str], now: float) -> bool:
        """True once no healthy group has reported ``high_water`` for ``heartbeat_timeout_s``."""
        if any(self.reported.get(g, 0) >= self.high_water for g in healthy):
            self.lost_since = None
            return False
        self.lost_since = self.lost_since if self.lost_since is not None else now
        return now - self.lost_since >= self.rules.heartbeat_timeout_s
