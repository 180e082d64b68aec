"""Who reaches whom: the lighthouse's reachability matrix and the largest set of groups that can meet.

Two groups that cannot reach each other while both reach the lighthouse (a cut between two hosts)
fail every round they share, and nothing dies. The lighthouse cannot see such a cut itself, so
each group's leader connects to its peers' probe endpoints (``diloco.ft.reach``) when a lane of
its failed or a new one is about to form, and reports which peers it reached and which it did
not; while a cut stands the lighthouse asks both sides to probe again, so a restored link is
seen within a heartbeat or two. Pure logic with time passed in, as ``diloco.ft.quorum``: the
rules in words are in docs/fault-tolerance.md, "Groups that cannot reach each other".
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

Pair = frozenset[str]
EXACT_SUSPECTS = 16  # up to this many groups on cut pairs, the largest set is found exactly; beyond, greedily
FLAP_DOUBLINGS = 3  # a pair cut again and again waits at most 2**3 times the hold before its groups meet
RATE_KEPT_S = 150.0  # a link's timed throughput counts this long (five of a leader's timing periods)
RATES_KEPT = 3  # a pair's latest timings; the fastest counts (a slow link is slow at every one)
MIN_TIMED_GROUPS = 3  # below this many groups with a timed link, no link can be told slower than the others
SLOW_SHARE = 0.1  # a slow link counts once the time it adds to a round is this share of the rounds' interval
BITS_PER_PAYLOAD_BYTE = 16  # a ring all-reduce sends and receives about twice the payload over each link


def pair(a: str, b: str) -> Pair:
    return frozenset((a, b))


@dataclass
class Reachability:
    """The latest probe result of every ordered pair of groups, and each group's probe endpoint.

    A pair is cut while either direction's latest probe failed. A pair that was cut before and is
    whole again is held apart for ``hold_s`` times 2**(cuts - 2) more (at most ``FLAP_DOUBLINGS``
    doublings) since it was seen whole: a link that flaps does not make its groups fail a round on
    each flap, while a pair cut once meets again as soon as both sides reach each other.
    """

    hold_s: float
    endpoints: dict[str, str] = field(default_factory=dict)  # group -> "host:port" of its probe listener
    latest: dict[tuple[str, str], tuple[bool, float]] = field(default_factory=dict)  # (from, to) -> (reached, when)
    cuts_seen: dict[Pair, int] = field(default_factory=dict)  # pair -> how often it was found cut
    cut_since: dict[Pair, float] = field(default_factory=dict)  # standing cuts -> since when
    whole_since: dict[Pair, float] = field(default_factory=dict)  # pairs cut before, whole again -> since when
    rates: dict[Pair, list[tuple[float, float]]] = field(default_factory=dict)  # pair -> its latest (Mbit/s, when)
    round_bytes: dict[str, int] = field(default_factory=dict)  # group -> what its lane carried in its last round

    def register(self, group: str, endpoint: str) -> None:
        """``group``'s probe endpoint; a new one (a new process) voids what was probed of the old one."""
        if self.endpoints.get(group) == endpoint:
            return
        self.endpoints[group] = endpoint
        self.forget(group)

    def report(
        self,
        group: str,
        reached: Mapping[str, str],
        unreached: Mapping[str, str],
        now: float,
        mbps: Mapping[str, float] | None = None,
    ) -> None:
        """``group``'s probes since its last report (peer -> the endpoint probed: one of a peer's
        earlier process counts for nothing), and the throughput of the links it timed."""
        for peer, rate in (mbps or {}).items():
            if peer != group:
                timings = self.rates.setdefault(pair(group, peer), [])
                timings[:] = [*timings, (rate, now)][-RATES_KEPT:]
        for peer, endpoint, ok in [
            *((p, e, True) for p, e in reached.items()),
            *((p, e, False) for p, e in unreached.items()),
        ]:
            if peer != group and self.endpoints.get(peer) == endpoint:
                self.latest[(group, peer)] = (ok, now)
                self._update(pair(group, peer), now)

    def forget(self, group: str) -> None:
        """A group that left the job (departed) or came back as a new process: what was probed of it
        no longer counts against anyone (a cut that still stands is found again at its next lane)."""
        for key in [k for k in self.latest if group in k]:
            del self.latest[key]
        for held in (self.cut_since, self.whole_since, self.rates):
            for p in [p for p in held if group in p]:
                del held[p]
        self.round_bytes.pop(group, None)

    def is_cut(self, a: str, b: str, now: float) -> bool:
        p = pair(a, b)
        if p in self.cut_since:
            return True
        since = self.whole_since.get(p)
        return since is not None and now - since < self._hold(p)

    def cuts(self, groups: Iterable[str], now: float) -> set[Pair]:
        """The cut pairs among ``groups`` (a pass over the standing cuts, not over every pair)."""
        members = set(groups)
        standing = [p for p in itertools.chain(self.cut_since, self.whole_since) if p <= members]
        return {p for p in standing if self.is_cut(*p, now)}

    def to_probe(self, group: str, now: float) -> dict[str, str]:
        """The peers ``group`` should probe again now: those of its pairs that are cut or held apart."""
        peers = {next(iter(p - {group})) for p in itertools.chain(self.cut_since, self.whole_since) if group in p}
        return {g: self.endpoints[g] for g in sorted(peers) if g in self.endpoints and self.is_cut(group, g, now)}

    def unreached_by(self, group: str, now: float) -> list[str]:
        """The peers ``group`` is cut from, for the reason a group is left out."""
        peers = {next(iter(p - {group})) for p in self.cut_since if group in p}
        return sorted(g for g in peers if self.is_cut(group, g, now))

    def link_mbps(self, now: float) -> dict[str, float]:
        """Each group's own link, as timed lately: the fastest timing of its pairs (a pair moves at its
        slower end, and a busy core slows a timing, never speeds it up)."""
        best: dict[str, float] = {}
        for p, timings in self.rates.items():
            for rate, at in timings:
                if now - at < RATE_KEPT_S:
                    for g in p:
                        best[g] = max(best.get(g, 0.0), rate)
        return best

    def slow_links(
        self, groups: Iterable[str], factor: float, round_interval_s: float, now: float
    ) -> dict[str, tuple[float, float]]:
        """The groups whose link is under ``1 / factor`` of the median of the others' (0: none) and
        would add over ``SLOW_SHARE`` of ``round_interval_s`` to a round (its round's bytes moved at
        its rate rather than the median's) -> (its Mbit/s, that median). An all-reduce moves at its
        slowest link, so one such group holds every round it is in to its pace; a link merely slower
        than the others, with little to carry, holds nothing up (and a busy core's timing of a fast
        link calls no group slow). Only among ``MIN_TIMED_GROUPS`` or more timed groups."""
        if factor <= 0 or not self.rates:
            return {}
        members = set(groups)
        links = sorted((r, g) for g, r in self.link_mbps(now).items() if g in members)
        if len(links) < MIN_TIMED_GROUPS:
            return {}
        slow = {}
        # Slowest first: past the first that is not slow, each is faster against a median no higher.
        for i, (rate, g) in enumerate(links):
            median = statistics.median(r for r, _ in links[:i] + links[i + 1 :])
            if rate * factor >= median:
                break
            megabits = BITS_PER_PAYLOAD_BYTE * self.round_bytes.get(g, 0) / 1e6
            if megabits / rate - megabits / median > SLOW_SHARE * round_interval_s:
                slow[g] = (rate, median)
        return slow

    def status(self, now: float) -> list[dict]:
        """The standing cuts and held pairs, for /status and the status page."""
        rows = []
        for p in sorted({*self.cut_since, *self.whole_since}, key=sorted):
            a, b = sorted(p)
            if not self.is_cut(a, b, now):
                continue
            reported = {f"{x}->{y}": self.latest[(x, y)][0] for x, y in ((a, b), (b, a)) if (x, y) in self.latest}
            since = self.cut_since.get(p)
            rows.append(
                {
                    "groups": [a, b],
                    "cut": since is not None,
                    "for_s": round(now - (since if since is not None else self.whole_since[p]), 1),
                    "times_cut": self.cuts_seen.get(p, 0),
                    "reached": reported,
                }
            )
        return rows

    def _update(self, p: Pair, now: float) -> None:
        a, b = sorted(p)
        failed = any(not self.latest.get(k, (True, 0.0))[0] for k in ((a, b), (b, a)))
        if failed and p not in self.cut_since:
            self.cut_since[p] = now
            self.cuts_seen[p] = self.cuts_seen.get(p, 0) + 1
            self.whole_since.pop(p, None)
        elif not failed and p in self.cut_since:
            del self.cut_since[p]
            self.whole_since[p] = now
        if p in self.whole_since and not self.is_cut(a, b, now) and self.cuts_seen.get(p, 0) <= 1:
            del self.whole_since[p]  # cut once and whole again: nothing to hold

    def _hold(self, p: Pair) -> float:
        cuts = self.cuts_seen.get(p, 0)
        return 0.0 if cuts <= 1 else self.hold_s * 2 ** min(cuts - 2, FLAP_DOUBLINGS)


def largest_reachable_set(
    groups: Iterable[str], cuts: set[Pair], position: Callable[[str], tuple[int, int]]
) -> frozenset[str]:
    """A largest set of ``groups`` in which every two reach each other (no pair of it in ``cuts``).

    Only groups on a cut pair ("suspects") can be left out: every other group reaches all. Among
    the suspects this is a maximum independent set of the cut graph: found exactly up to
    ``EXACT_SUSPECTS`` of them, preferring, among the largest sets, the one holding the freshest
    state (``position``: the furthest, then most groups at it; the lighthouse ranks by committed
    round, then membership of the last quorum, so the side that trains stays the same), then the
    first by sorted names; beyond that, greedily: the suspect with the most cut pairs left goes first (ties: the
    one behind, then the last by name), until no cut is left.
    """
    members = set(groups)
    cuts = {p for p in cuts if p <= members}
    suspects = sorted({g for p in cuts for g in p})
    if not suspects:
        return frozenset(members)
    fine = members - set(suspects)
    kept = _exact(suspects, cuts, fine, position) if len(suspects) <= EXACT_SUSPECTS else _greedy(cuts, position)
    return frozenset(fine | kept)


def by_name(group: str) -> tuple[int, str]:
    """Names in their natural order: group2 before group10."""
    return (len(group), group)


def _preference(chosen: frozenset[str], position: Callable[[str], tuple[int, int]]) -> tuple:
    """How a candidate set ranks: larger, then fresher (furthest position, groups at it), then the
    set whose names come first (compared in natural order, member by member)."""
    positions = [position(g) for g in chosen]
    furthest = max(positions, default=(0, 0))
    names = tuple(sorted(chosen, key=by_name))
    return (len(chosen), furthest, positions.count(furthest), [(-len(n), tuple(-ord(c) for c in n)) for n in names])


def _exact(
    suspects: list[str], cuts: set[Pair], fine: set[str], position: Callable[[str], tuple[int, int]]
) -> frozenset[str]:
    """Every maximal independent set of the suspects, the best by ``_preference`` (with the others)."""
    neighbours = {g: {next(iter(p - {g})) for p in cuts if g in p} for g in suspects}
    best: tuple | None = None
    kept: frozenset[str] = frozenset()

    def grow(chosen: frozenset[str], rest: list[str]) -> None:
        nonlocal best, kept
        if best is not None and len(fine) + len(chosen) + len(rest) < best[0]:
            return  # cannot reach the best size any more
        if not rest:
            if all(neighbours[g] & chosen for g in suspects if g not in chosen):  # maximal
                rank = _preference(frozenset(fine) | chosen, position)
                if best is None or rank > best:
                    best, kept = rank, chosen
            return
        head, tail = rest[0], rest[1:]
        grow(chosen | {head}, [g for g in tail if g not in neighbours[head]])
        grow(chosen, tail)

    grow(frozenset(), suspects)
    return kept


def _greedy(cuts: set[Pair], position: Callable[[str], tuple[int, int]]) -> frozenset[str]:
    left = set(cuts)
    out: set[str] = set()
    while left:
        degree: dict[str, int] = {}
        for p in left:
            for g in p:
                degree[g] = degree.get(g, 0) + 1
        worst = max(degree, key=lambda g: (degree[g], tuple(-x for x in position(g)), g))
        out.add(worst)
        left = {p for p in left if worst not in p}
    return frozenset({g for p in cuts for g in p} - out)
