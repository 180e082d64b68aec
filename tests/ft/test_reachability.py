"""Who reaches whom, as pure rules: the matrix from probes, the largest set that can meet, and how the
lighthouse's book uses them (docs/fault-tolerance.md, "Groups that cannot reach each other"). And the
probes themselves, on loopback."""

from __future__ import annotations

import itertools
import socket
import time

from diloco.config.cluster import QuorumRules
from diloco.ft import reach as reach_module
from diloco.ft import status_page
from diloco.ft.protocol import GroupProgress
from diloco.ft.quorum import Quorum, QuorumBook, QuorumRequest
from diloco.ft.reach import ReachListener, ReachProbes, probe, throughput_mbps
from diloco.ft.reachability import EXACT_SUSPECTS, Reachability, largest_reachable_set, pair

LEVEL = (0, 0)


def level(_: str) -> tuple[int, int]:
    return LEVEL


def cuts(*pairs: tuple[str, str]) -> set[frozenset[str]]:
    return {pair(a, b) for a, b in pairs}


def groups(n: int) -> list[str]:
    return [f"g{i}" for i in range(n)]


def endpoint(group: str) -> str:
    return f"127.0.0.1:{1000 + int(group[1:])}"


def at(*peers: str) -> dict[str, str]:
    """Probe results as a report names them: each peer with the endpoint probed."""
    return {g: endpoint(g) for g in peers}


def matrix(n: int, hold_s: float) -> Reachability:
    reach = Reachability(hold_s=hold_s)
    for g in groups(n):
        reach.register(g, endpoint(g))
    return reach


def test_a_pair_split_keeps_everyone_else_and_the_first_side_by_name_unless_the_other_is_fresher():
    assert largest_reachable_set(groups(3), cuts(("g0", "g1")), level) == {"g0", "g2"}
    assert largest_reachable_set(groups(4), cuts(("g0", "g1")), level) == {"g0", "g2", "g3"}
    fresher = {"g1": (5, 0)}
    assert largest_reachable_set(groups(3), cuts(("g0", "g1")), lambda g: fresher.get(g, (4, 0))) == {"g1", "g2"}
    at_step = {"g1": (4, 20)}  # same round, further in inner steps
    assert largest_reachable_set(groups(3), cuts(("g0", "g1")), lambda g: at_step.get(g, (4, 0))) == {"g1", "g2"}


def test_two_against_two_keeps_one_side_whole_and_one_group_cut_from_half_the_others_goes_alone():
    halves = cuts(*((a, b) for a in ("g0", "g1") for b in ("g2", "g3")))
    assert largest_reachable_set(groups(4), halves, level) == {"g0", "g1"}
    assert largest_reachable_set(groups(4), cuts(("g3", "g0"), ("g3", "g1")), level) == {"g0", "g1", "g2"}
    assert largest_reachable_set(groups(4), set(), level) == set(groups(4)), "no cut: everyone"
    assert largest_reachable_set(groups(2), cuts(("g0", "g5")), level) == {"g0", "g1"}, "a cut outside counts not"


def test_natural_order_breaks_ties_group2_before_group10():
    names = [f"group{i}" for i in (2, 10, 11)]
    assert largest_reachable_set(names, cuts(("group2", "group10")), level) == {"group2", "group11"}


def test_the_exact_rule_finds_a_largest_set_that_is_all_reachable_on_every_small_cut_graph():
    """Against brute force over every subset, for every cut graph on 5 groups."""
    names = groups(5)
    every_pair = list(itertools.combinations(names, 2))
    for mask in range(0, 1 << len(every_pair), 7):  # a spread of the 1,024 graphs
        cut = {pair(*p) for i, p in enumerate(every_pair) if mask >> i & 1}
        chosen = largest_reachable_set(names, cut, level)
        assert not any(pair(a, b) in cut for a, b in itertools.combinations(chosen, 2)), (cut, chosen)
        best = max(
            len(s)
            for r in range(len(names) + 1)
            for s in itertools.combinations(names, r)
            if not any(pair(a, b) in cut for a, b in itertools.combinations(s, 2))
        )
        assert len(chosen) == best, (cut, chosen)


def test_beyond_the_exact_limit_the_greedy_rule_still_gives_a_reachable_set_and_drops_only_suspects():
    names = groups(1000)
    cut = {pair(f"g{2 * i}", f"g{2 * i + 1}") for i in range(EXACT_SUSPECTS)}  # 2x the exact limit on cut pairs
    cut |= cuts(("g500", "g501"), ("g500", "g502"), ("g500", "g503"))
    chosen = largest_reachable_set(names, cut, level)
    assert not any(p <= chosen for p in cut)
    assert len(chosen) == 1000 - EXACT_SUSPECTS - 1, "one per split pair, and the hub of the star"
    assert "g500" not in chosen and {"g501", "g502", "g503"} <= chosen
    assert set(names) - {g for p in cut for g in p} <= chosen, "a group on no cut pair is never left out"


def test_a_pair_is_cut_while_either_side_fails_and_whole_once_both_reach_again():
    reach = matrix(3, hold_s=60.0)
    reach.report("g0", reached=at("g2"), unreached=at("g1"), now=1.0)
    assert reach.is_cut("g0", "g1", 1.0) and reach.is_cut("g1", "g0", 1.0) and not reach.is_cut("g0", "g2", 1.0)
    reach.report("g1", reached=at("g0"), unreached={}, now=2.0)
    assert reach.is_cut("g0", "g1", 2.0), "g0's latest probe still failed"
    reach.report("g0", reached=at("g1"), unreached={}, now=3.0)
    assert not reach.is_cut("g0", "g1", 3.0), "cut once: whole again at once"
    assert reach.cuts(["g0", "g1", "g2"], 3.0) == set()


def test_a_pair_that_flaps_is_held_apart_longer_each_time_it_is_cut_again():
    reach = matrix(2, hold_s=10.0)
    now = 0.0
    holds = []
    for _ in range(5):
        reach.report("g0", reached={}, unreached=at("g1"), now=now)
        now += 1.0
        reach.report("g0", reached=at("g1"), unreached={}, now=now)
        whole_at = now
        while reach.is_cut("g0", "g1", now):
            now += 1.0
        holds.append(now - whole_at)
    assert holds == [0.0, 10.0, 20.0, 40.0, 80.0], "cut once: none; then doubling, at most 2**3 times"
    reach.report("g0", reached={}, unreached=at("g1"), now=now)
    reach.register("g1", "127.0.0.1:5001")  # a new process of g1
    assert not reach.is_cut("g0", "g1", now), "what was probed of its old process no longer counts"
    reach.report("g0", reached={}, unreached=at("g1"), now=now)
    assert not reach.is_cut("g0", "g1", now), "nor a late result about the old one's endpoint"
    reach.report("g0", reached={}, unreached={"g1": "127.0.0.1:5001"}, now=now)
    assert reach.is_cut("g0", "g1", now)


def test_the_lighthouse_asks_both_sides_of_a_standing_cut_to_probe_again_and_only_them():
    reach = matrix(3, hold_s=10.0)
    reach.report("g0", reached=at("g2"), unreached=at("g1"), now=0.0)
    assert reach.to_probe("g0", 0.0) == at("g1") and reach.to_probe("g1", 0.0) == at("g0")
    assert reach.to_probe("g2", 0.0) == {}
    assert [row["groups"] for row in reach.status(0.0)] == [["g0", "g1"]]
    reach.forget("g1")
    assert reach.to_probe("g0", 0.0) == {} and reach.status(0.0) == []


def test_a_link_under_a_quarter_of_the_others_median_that_holds_rounds_up_is_slow():
    reach = Reachability(hold_s=10.0)
    # g3's host is slow: every pair with it moves at its pace; the others' pairs at theirs.
    for a, b in itertools.combinations(groups(4), 2):
        reach.report(a, {}, {}, now=0.0, mbps={b: 20.0 if "g3" in (a, b) else 200.0})
    reach.round_bytes = dict.fromkeys(groups(4), 250_000)  # 4 Mbit a round: 0.2 s at 20 Mbit/s, 0.02 s at 200
    assert reach.link_mbps(0.0) == {"g0": 200.0, "g1": 200.0, "g2": 200.0, "g3": 20.0}
    assert reach.slow_links(groups(4), factor=4.0, round_interval_s=0.6, now=1.0) == {"g3": (20.0, 200.0)}
    assert reach.slow_links(groups(4), 4.0, round_interval_s=5.0, now=1.0) == {}, "0.18 s more of a 5 s round"
    assert reach.slow_links(groups(4), factor=0.0, round_interval_s=0.6, now=1.0) == {}, "0: never"
    assert reach.slow_links(groups(4), 20.0, 0.6, now=1.0) == {}, "10x slower is within a factor of 20"
    assert reach.slow_links(["g0", "g3"], 4.0, 0.6, now=1.0) == {}, "two groups: neither tells who is slow"
    assert reach.slow_links(groups(4), 4.0, 0.6, now=1000.0) == {}, "timings age out"
    reach.round_bytes["g3"] = 0
    assert reach.slow_links(groups(4), 4.0, 0.6, now=1.0) == {}, "nothing to carry: nothing held up"
    reach.round_bytes["g3"] = 250_000
    reach.report("g3", {}, {}, now=2.0, mbps={"g0": 190.0})  # g3's link is fast again: its fastest timing counts
    assert reach.slow_links(groups(4), 4.0, 0.6, now=3.0) == {}


def test_a_busy_cores_slow_timings_of_a_fast_link_call_no_group_slow():
    reach = Reachability(hold_s=10.0)
    for a, b in itertools.combinations(groups(3), 2):
        reach.report(a, {}, {}, now=0.0, mbps={b: 9000.0})
    reach.report("g0", {}, {}, now=1.0, mbps={"g2": 40.0})  # a timing on busy cores
    reach.report("g1", {}, {}, now=1.0, mbps={"g2": 60.0})
    reach.round_bytes = dict.fromkeys(groups(3), 250_000)
    assert reach.link_mbps(1.0)["g2"] == 9000.0, "the fastest of a pair's last timings"
    for pair_rates in reach.rates.values():
        pair_rates[:] = [(40.0, 1.0)]  # every timing slow, but 4 Mbit at 40 Mbit/s is 0.1 s of a 3 s round
    assert reach.slow_links(groups(3), factor=4.0, round_interval_s=3.0, now=1.0) == {}


def test_a_throughput_probe_times_bytes_a_listener_acknowledged():
    listener = ReachListener(timeout_s=1.0)
    endpoint = f"127.0.0.1:{listener.port}"
    try:
        rate = throughput_mbps(endpoint, timeout_s=2.0)
        assert rate is not None and rate > 1.0, "loopback moves 256 KB in well under two seconds"
    finally:
        listener.close()
    assert throughput_mbps(endpoint, timeout_s=1.0) is None, "nobody listens"


class TestTheBook:
    """The lighthouse's book with probes: a cut pair's round fails once, then the largest set meets."""

    RULES = QuorumRules(min_groups=1, join_timeout_s=5.0, heartbeat_timeout_s=1000.0, sit_out_s=60.0)

    def _round(self, book: QuorumBook, asks: dict[str, list[str]], now: float, failed: bool = False) -> Quorum | None:
        """Each group asks at the step it last reported, reporting the peers its probes did not
        reach (and reached the rest)."""
        everyone = set(book.last_heartbeat) | set(asks)
        for g, unreached in asks.items():
            book.reach_report(g, "127.0.0.1", 1000 + int(g[1:]), {}, {}, now)  # its endpoint first
        for g, unreached in asks.items():
            reached = sorted(everyone - {g} - set(unreached))
            book.reach_report(g, "127.0.0.1", 1000 + int(g[1:]), at(*reached), at(*unreached), now)
            step = book.reported.get(g, 0)
            book.ask(QuorumRequest(g, step=step, commit_failed=failed, lane_failed=failed), now=now)
        return book.decide(now=now)

    def test_a_pair_split_mid_job_costs_one_round_and_the_third_group_never_sits_out(self):
        book = QuorumBook(self.RULES)
        assert self._round(book, {"g0": [], "g1": [], "g2": []}, now=0.0).participants == ("g0", "g1", "g2")
        split = {"g0": ["g1"], "g1": ["g0"], "g2": []}
        for now in (30.0, 31.0, 32.0, 33.0):  # the split round failed; later rounds all work
            q = self._round(book, split, now=now, failed=now == 30.0)
            assert q.participants == ("g0", "g2"), f"the largest set at {now}"
            assert "it cannot reach g0" in book.turned_away.pop("g1")
            book.turned_away.clear()
            step = book.high_water + 1
            assert not book.commit("g0", q.round_id, step, now) and not book.commit("g2", q.round_id, step, now)
        assert not book.sitting_out and book.failed_in_a_row == 0, "the cut explains the failure: nobody benched"
        assert q.endpoints == {"g0": "127.0.0.1:1000", "g2": "127.0.0.1:1002"}
        # The link is back: the next probes of g0 and g1 reach; g1 is back in the next round, behind: it heals.
        q = self._round(book, {"g0": [], "g1": [], "g2": []}, now=40.0)
        assert q.participants == ("g0", "g1", "g2") and q.heal_from == {"g1": "g0"}

    def test_the_side_of_a_cut_that_trains_does_not_flip_with_whoever_asks_first(self):
        book = QuorumBook(self.RULES)
        self._round(book, {g: [] for g in groups(3)}, now=0.0)
        q = self._round(book, {"g0": ["g1"], "g1": ["g0"], "g2": []}, now=1.0, failed=True)
        assert q.participants == ("g0", "g2")
        book.turned_away.clear()
        for now in (2.0, 3.0):  # g1 and g2 ask while g0 is still training its window
            for g in ("g1", "g2"):
                book.ask(QuorumRequest(g, step=book.reported.get(g, 0), round_step=int(now) * 20), now=now)
            assert book.decide(now=now) is None, "no quorum of g1 and g2 behind g0's back"
            assert "it cannot reach g0" in book.turned_away.pop("g1")
        book.ask(QuorumRequest("g0", step=0, round_step=60), now=3.5)
        assert book.decide(now=3.5).participants == ("g0", "g2")

    def test_a_pair_split_at_the_start_ends_the_first_round_for_everyone_at_the_probe_that_found_it(self):
        book = QuorumBook(self.RULES)
        first = self._round(book, {g: [] for g in groups(3)}, now=0.0)
        assert first.participants == ("g0", "g1", "g2")
        book.reach_report("g0", "127.0.0.1", 1000, {}, at("g1"), 0.5)  # its probe before the lane formed
        assert book.give_up_cut_rounds("g0", 0.5) and not book.give_up_cut_rounds("g2", 0.5)
        told = book.break_rounds(0.5)
        assert told["g2"] == f"group g0 left round {first.round_id}: it cannot reach g1 (its probes)"
        q = self._round(book, {"g0": ["g1"], "g1": ["g0"], "g2": []}, now=1.0, failed=True)
        assert q.participants == ("g0", "g2") and not book.sitting_out

    def test_two_against_two_one_half_trains_on_without_a_majority_of_every_healthy_group(self):
        book = QuorumBook(self.RULES)
        self._round(book, {g: [] for g in groups(4)}, now=0.0)
        halves = {"g0": ["g2", "g3"], "g1": ["g2", "g3"], "g2": ["g0", "g1"], "g3": ["g0", "g1"]}
        q = self._round(book, halves, now=30.0, failed=True)
        assert q.participants == ("g0", "g1"), "a majority of the groups that can meet"
        assert set(book.turned_away) == {"g2", "g3"}

    def test_a_group_on_a_slow_link_is_turned_away_with_its_measurement_and_back_when_timed_faster(self):
        book = QuorumBook(QuorumRules(min_groups=1, join_timeout_s=5.0, heartbeat_timeout_s=1000.0, slow_link_factor=4))
        for now in (0.0, 0.5):  # rounds every 0.5 s
            self._round(book, {g: [] for g in groups(3)}, now=now)
        book.reach_report("g0", "127.0.0.1", 1000, {}, {}, 1.0, {"g1": 200.0, "g2": 15.0}, round_bytes=250_000)
        book.reach_report("g1", "127.0.0.1", 1001, {}, {}, 1.0, {"g2": 25.0}, round_bytes=250_000)
        book.reach_report("g2", "127.0.0.1", 1002, {}, {}, 1.0, round_bytes=250_000)
        q = self._round(book, {g: [] for g in groups(3)}, now=1.0)
        assert q.participants == ("g0", "g1")
        assert "its link was timed at 25 Mbit/s against the others' median 200" in book.turned_away["g2"]
        book.reach_report("g2", "127.0.0.1", 1002, {}, {}, 3.0, {"g0": 180.0})
        assert self._round(book, {g: [] for g in groups(3)}, now=4.0).participants == ("g0", "g1", "g2")

    def test_a_closing_round_hands_the_final_state_only_to_groups_that_reach_a_holder(self):
        book = QuorumBook(self.RULES)
        self._round(book, {"g0": [], "g1": []}, now=0.0)
        book.heartbeat("g0", now=1.0, step=5)
        book.reach_report("g0", "127.0.0.1", 1000, {}, at("g1"), 1.0)
        book.ask(QuorumRequest("g0", step=5, finished=True, digest="d5"), now=1.0)
        book.ask(QuorumRequest("g1", step=3, finished=True, digest="d3"), now=1.0)
        assert book.decide(now=1.0) is None and "it cannot reach g0" in book.turned_away["g1"]
        book.reach_report("g0", "127.0.0.1", 1000, at("g1"), {}, 2.0)
        book.ask(QuorumRequest("g1", step=3, finished=True, digest="d3"), now=2.0)
        book.ask(QuorumRequest("g0", step=5, finished=True, digest="d5"), now=2.0)
        q = book.decide(now=2.0)
        assert q.closing and q.heal_from == {"g1": "g0"}


def test_probes_reach_a_listener_and_not_a_closed_port_within_their_timeout():
    probes = ReachProbes(timeout_s=1.0, interval_s=0.05)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = closed.getsockname()[1]
    closed.close()
    try:
        endpoints = {"g1": f"127.0.0.1:{probes.port}", "g2": f"127.0.0.1:{dead}", "g3": "not an endpoint"}
        assert probe(endpoints, 1.0) == (["g1"], ["g2", "g3"])
        assert probes.probe_now(endpoints) == ["g2", "g3"]
        report = probes.report()
        assert report == {"port": probes.port, "reached": {}, "unreached": report["unreached"], "mbps": {}}
        assert report["unreached"] == {"g2": endpoints["g2"], "g3": endpoints["g3"]}, "reached is no news of g1"
        probes.keep_unsent({"reached": {}, "unreached": {"g2": endpoints["g2"]}})
        assert "g2" in probes.report()["unreached"], "a report that did not arrive goes out again"
        back = ReachListener()  # a suspect the lighthouse named, reachable: found in the background
        probes.suspect({"g2": endpoints["g2"], "g4": f"127.0.0.1:{back.port}"})
        deadline = time.monotonic() + 5.0
        while "g4" not in (reported := probes.report())["reached"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "g4" in reported["reached"] and "g2" in reported["unreached"], "suspects are probed until reached"
        time.sleep(0.2)
        assert "g4" not in probes.report()["reached"], "a suspect reached is probed, and reported, no more"
        back.close()
    finally:
        probes.close()


def test_the_status_page_shows_the_cut_pairs_and_each_groups_steps_since_its_last_commit():
    book = QuorumBook(QuorumRules(min_groups=1, sit_out_s=60.0))
    for g in groups(3):
        book.heartbeat(g, now=0.0)
        book.reach_report(g, "127.0.0.1", 1000 + int(g[1:]), {}, {}, 0.0)
    book.reach_report("g0", "127.0.0.1", 1000, at("g2"), at("g1"), 1.0)
    board = status_page.StatusBoard()
    board.event("cut", "g0", "g0 and g1 cannot reach each other")
    board.progress("g1", GroupProgress(inner_step=360))
    board.committed("g1")  # its last commit, at step 360; it trained on apart since
    board.progress("g1", GroupProgress(inner_step=1500))
    status = status_page.build_status(status_page.snapshot("job", None, book, {}, None, [], 2.0, board))
    since = {g["id"]: g["steps_since_commit"] for g in status["groups"]}
    assert since == {"g0": None, "g1": 1140, "g2": None}, "the steps no commit of it carries yet"
    assert status["reachability"]["cuts"] == [
        {"groups": ["g0", "g1"], "cut": True, "for_s": 1.0, "times_cut": 1, "reached": {"g0->g1": False}}
    ]
    page = status_page.render_html(status)
    assert "who cannot reach whom" in page and "g0 and g1" in page and "g0-&gt;g1: not reached" in page


def test_a_round_still_open_after_a_while_gets_its_peers_probed_once(monkeypatch):
    monkeypatch.setattr(reach_module, "ROUND_PROBED_AFTER_S", 0.2)
    probes = ReachProbes(timeout_s=1.0, interval_s=0.05)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    peers = {"g1": f"127.0.0.1:{closed.getsockname()[1]}"}  # nobody listens: a cut, as a probe sees it
    closed.close()
    try:
        probes.round_opened(peers)
        probes.round_closed()
        time.sleep(0.5)
        assert probes.report()["unreached"] == {}, "a round that closed in time probes nobody"
        probes.round_opened(peers)
        deadline = time.monotonic() + 5.0
        while not (reported := probes.report())["unreached"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reported["unreached"] == peers, "held up: its peers probed"
        assert probes.suspecting, "and the one not reached probed again until the lighthouse says otherwise"
        probes.suspect({})
        time.sleep(0.3)
        probes.report()  # a probe of the suspect that was under way
        time.sleep(0.5)
        assert probes.report()["unreached"] == {}, "once per round"
    finally:
        probes.close()
