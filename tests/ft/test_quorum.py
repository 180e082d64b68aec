"""Quorum rules as pure functions: time is a number the test chooses."""

from __future__ import annotations

import pytest

from diloco.config.cluster import QuorumRules
from diloco.ft.quorum import (
    JobEnd,
    Quorum,
    QuorumBook,
    QuorumRequest,
    assign_healing,
    healthy_groups,
    join_wait,
    next_quorum_id,
    quorum_ready,
)

RULES = QuorumRules(min_groups=2, join_timeout_s=5.0, heartbeat_timeout_s=10.0)


def test_healthy_means_heartbeat_younger_than_timeout():
    beats = {"a": 100.0, "b": 95.0, "c": 90.0}
    assert healthy_groups(beats, now=100.0, timeout_s=10.0) == {"a", "b"}  # c is exactly 10 s old


def test_ready_when_every_healthy_group_asked():
    assert quorum_ready({"a", "b"}, {"a", "b"}, None, join_clock_start=0.0, now=0.0, rules=RULES)


def test_waits_for_healthy_groups_until_join_timeout():
    args = dict(askers={"a", "b"}, healthy={"a", "b", "c"}, previous=None, join_clock_start=10.0, rules=RULES)
    assert not quorum_ready(now=14.9, **args)
    assert quorum_ready(now=15.0, **args)


def test_no_join_clock_means_no_timeout_path():
    assert not quorum_ready({"a", "b"}, {"a", "b", "c"}, None, join_clock_start=None, now=100.0, rules=RULES)


def test_never_below_min_groups_even_after_timeout():
    assert not quorum_ready({"a"}, {"a"}, None, join_clock_start=0.0, now=100.0, rules=RULES)


def test_split_brain_guard_needs_a_strict_majority_of_heartbeating_groups():
    healthy = {"a", "b", "c", "d"}
    assert not quorum_ready({"a", "b"}, healthy, None, join_clock_start=0.0, now=100.0, rules=RULES)
    assert quorum_ready({"a", "b", "c"}, healthy, None, join_clock_start=0.0, now=100.0, rules=RULES)


def test_fast_path_when_the_previous_quorum_asks_again_in_full():
    healthy = {"a", "b", "c"}  # c is new and has not asked yet
    assert quorum_ready({"a", "b"}, healthy, ("a", "b"), join_clock_start=0.0, now=0.0, rules=RULES)
    assert not quorum_ready({"a", "b"}, healthy, ("a", "b", "c"), join_clock_start=0.0, now=0.0, rules=RULES)


def test_join_wait_scales_with_measured_ask_skew_between_join_and_heartbeat_timeouts():
    rules = QuorumRules(min_groups=1, join_timeout_s=0.5, heartbeat_timeout_s=3.0)
    assert join_wait([], rules) == 0.5  # nothing measured: the configured join timeout
    assert join_wait(None, rules) == 3.0  # a job's first round after its start: up to the heartbeat timeout
    assert join_wait([0.05, 0.1], rules) == 0.5  # never below it
    assert join_wait([0.3, 0.7, 0.6], rules) == pytest.approx(2.1)  # SKEW_MARGIN (3) x the largest recent skew
    assert join_wait([9.0], rules) == 3.0  # never past the heartbeat timeout
    assert join_wait([9.0], QuorumRules(join_timeout_s=5.0, heartbeat_timeout_s=3.0)) == 5.0


def test_ready_after_the_given_wait_instead_of_the_join_timeout():
    args = dict(askers={"a", "b"}, healthy={"a", "b", "c"}, previous=None, join_clock_start=10.0, rules=RULES)
    assert not quorum_ready(now=16.9, wait_s=7.0, **args)
    assert quorum_ready(now=17.0, wait_s=7.0, **args)


def test_healing_sources_are_up_to_date_peers_spread_evenly():
    heal = assign_healing({g: (s, 0) for g, s in {"a": 10, "b": 10, "c": 7, "d": 0, "e": 9, "f": 10}.items()})
    assert heal == {"c": "a", "d": "b", "e": "f"}
    assert assign_healing({"a": (3, 40), "b": (3, 40)}) == {}


def test_quorum_id_changes_exactly_on_membership_change_or_when_fresh_lanes_are_needed():
    previous = Quorum(4, ("a", "b"), 10, {})
    assert next_quorum_id(None, ("a",), False) == 1
    assert next_quorum_id(previous, ("a", "b"), False) == 4
    assert next_quorum_id(previous, ("a", "b"), True) == 5
    assert next_quorum_id(previous, ("a", "b", "c"), False) == 5
    assert next_quorum_id(previous, ("a",), False) == 5


def test_quorum_json_round_trip():
    q = Quorum(3, ("g0", "g2"), 17, {"g2": "g0"})
    assert Quorum.from_json(q.to_json()) == q
    assert q.rank_of("g2") == 1


class TestBook:
    def _book(self) -> QuorumBook:
        book = QuorumBook(RULES)
        for g in ("g0", "g1", "g2"):
            book.heartbeat(g, now=0.0)
        return book

    def test_forms_once_all_asked_in_fixed_order_with_healing(self):
        book = self._book()
        book.ask(QuorumRequest("g2", step=5), now=1.0)
        book.ask(QuorumRequest("g0", step=5), now=1.0)
        assert book.decide(now=1.0) is None
        book.ask(QuorumRequest("g1", step=0), now=1.5)
        q = book.decide(now=1.5)
        assert q == Quorum(1, ("g0", "g1", "g2"), 5, {"g1": "g0"}, round_id=1)
        assert book.pending == {} and book.decide(now=1.6) is None

    def test_everyone_asked_once_every_group_heard_from_has_asked_and_a_departed_one_is_not_waited_for(self):
        """The lighthouse's hint to decide at once, without the pause between passes."""
        book = self._book()
        book.ask(QuorumRequest("g0", step=1), now=1.0)
        book.ask(QuorumRequest("g1", step=1), now=1.0)
        assert not book.everyone_asked()
        book.depart("g2")
        assert book.everyone_asked()
        book.decide(now=1.0)
        assert not book.everyone_asked(), "the round formed: nobody is asking"

    def test_steady_state_keeps_the_id_and_a_dead_group_changes_it(self):
        book = self._book()
        for g in ("g0", "g1", "g2"):
            book.ask(QuorumRequest(g, step=1), now=1.0)
        first = book.decide(now=1.0)
        for g in ("g0", "g1", "g2"):
            book.ask(QuorumRequest(g, step=2), now=2.0)
        assert book.decide(now=2.0).quorum_id == first.quorum_id
        # g2 dies: its heartbeat ages out, the other two wait for the join timeout.
        for g in ("g0", "g1"):
            book.heartbeat(g, now=11.0)
            book.ask(QuorumRequest(g, step=3), now=11.0)
        assert book.decide(now=11.0) is None  # g2 is still healthy (heartbeat at 2.0)
        q = book.decide(now=12.0)
        assert q.participants == ("g0", "g1") and q.quorum_id == first.quorum_id + 1

    def test_a_member_that_came_back_behind_gets_fresh_lanes_though_membership_looks_unchanged(self):
        """g2 died and restarted between two quorums: same participants, but its old lane is gone."""
        book = self._book()
        for g in ("g0", "g1", "g2"):
            book.ask(QuorumRequest(g, step=4), now=1.0)
        first = book.decide(now=1.0)
        book.ask(QuorumRequest("g0", step=5), now=2.0)
        book.ask(QuorumRequest("g1", step=5), now=2.0)
        book.ask(QuorumRequest("g2", step=0), now=2.0)
        q = book.decide(now=2.0)
        assert q.participants == first.participants and q.heal_from == {"g2": "g0"}
        assert q.quorum_id == first.quorum_id + 1

    def test_groups_level_in_rounds_but_at_different_inner_steps_never_reduce_together(self):
        """After a lighthouse outage each group skipped its own number of windows: same θ_g,
        different launch steps, hence different fragments due. Reducing them together would
        sum one fragment's Δ into another's; the groups behind heal to the furthest instead."""
        book = self._book()
        book.ask(QuorumRequest("g0", step=11, round_step=120), now=1.0)
        book.ask(QuorumRequest("g1", step=11, round_step=130), now=1.0)
        book.ask(QuorumRequest("g2", step=11, round_step=130), now=1.0)
        q = book.decide(now=1.0)
        assert q.participants == ("g0", "g1", "g2") and q.max_step == 11
        assert q.heal_from == {"g0": "g1"}

    def test_an_asker_that_stops_heartbeating_is_dropped_from_pending(self):
        book = QuorumBook(QuorumRules(min_groups=1, join_timeout_s=60.0, heartbeat_timeout_s=2.0))
        book.ask(QuorumRequest("a", step=0), now=0.0)
        book.heartbeat("b", now=0.0)
        book.heartbeat("b", now=5.0)
        book.ask(QuorumRequest("b", step=0), now=5.0)
        q = book.decide(now=5.0)  # a's last sign of life was at 0.0: not waited for, not included
        assert q is not None and q.participants == ("b",)

    def test_a_newcomer_asking_between_rounds_does_not_start_the_join_clock(self):
        """Regression: members must not take turns being left out after a late joiner asks."""
        book = QuorumBook(QuorumRules(min_groups=1, join_timeout_s=1.0, heartbeat_timeout_s=100.0))
        for g in ("a", "b", "c", "j"):
            book.heartbeat(g, now=0.0)
        for g in ("a", "b", "c"):
            book.ask(QuorumRequest(g, step=1), now=0.0)
        assert book.decide(now=1.0).participants == ("a", "b", "c")
        book.ask(QuorumRequest("j", step=0), now=1.5)  # asks just after the round formed
        book.ask(QuorumRequest("a", step=2), now=10.0)
        book.ask(QuorumRequest("b", step=2), now=10.0)
        assert book.decide(now=10.0) is None  # c is about to ask: wait for it, do not drop it
        book.ask(QuorumRequest("c", step=2), now=10.2)
        q = book.decide(now=10.2)
        assert q.participants == ("a", "b", "c", "j") and q.heal_from == {"j": "a"}

    def test_a_members_replacement_asking_at_once_to_heal_does_not_start_the_join_clock(self):
        """A member died and its new process asked at once, behind, to heal; its ask
        started the clock, so when the others asked a window later the round formed the moment a
        majority had (627 of 1,000 groups in experiments/scale/lighthouse_scale.py). The clock starts
        at the first ask at the members' furthest position."""
        book = QuorumBook(QuorumRules(min_groups=1, join_timeout_s=1.0, heartbeat_timeout_s=100.0))
        for g in "abcde":
            book.heartbeat(g, now=0.0)
        for g in "abcde":
            book.ask(QuorumRequest(g, step=1), now=0.0)
        assert book.decide(now=1.0).participants == ("a", "b", "c", "d", "e")
        book.depart("a")  # killed; its replacement asks at once from the step it restored
        book.heartbeat("a", now=2.0)
        book.ask(QuorumRequest("a", step=0), now=2.0)
        assert book.join_clock_start() == 2.0, "alone, it is the furthest position asked at"
        for g in "bcd":
            book.ask(QuorumRequest(g, step=2), now=10.0)
        assert book.join_clock_start() == 10.0
        assert book.decide(now=10.0) is None, "e is about to ask: wait for it, do not drop it"
        book.ask(QuorumRequest("e", step=2), now=10.2)
        q = book.decide(now=10.2)
        assert q.participants == ("a", "b", "c", "d", "e") and q.heal_from == {"a": "b"}

    @staticmethod
    def _round(book, asks: dict[str, float], step: int, decide_at: float):
        for g, t in sorted(asks.items(), key=lambda kv: kv[1]):
            book.ask(QuorumRequest(g, step=step, round_step=10 * step), now=t)
        return book.decide(now=decide_at)

    def test_a_group_that_asked_after_its_round_closed_is_waited_for_in_the_next(self):
        """On a busy machine groups ask up to a second apart; a fixed 0.5 s join wait
        left the late ones out of every other round (they healed). The late ask is measured,
        and the next rounds wait long enough for it."""
        book = QuorumBook(QuorumRules(min_groups=1, join_timeout_s=0.5, heartbeat_timeout_s=3.0))
        for g in "abcd":
            book.heartbeat(g, now=0.0)
        first = self._round(book, dict.fromkeys("abcd", 0.0), 0, 0.0)  # the job's first round (start rule)
        assert first.participants == ("a", "b", "c", "d")
        for g in "abcd":
            book.heartbeat(g, now=9.0)
        assert self._round(book, {"a": 10.0, "b": 10.1, "c": 10.2}, 1, 10.4) is None  # d is healthy: wait
        assert book.decide(now=10.5).participants == ("a", "b", "c")  # 0.5 s passed: d left out
        book.ask(QuorumRequest("d", step=1, round_step=10), now=10.8)  # 0.8 s after the clock started
        assert book.join_wait() == pytest.approx(2.4)
        for g in "abcd":
            book.heartbeat(g, now=19.0)
        q = self._round(book, {"a": 20.0, "b": 20.2, "c": 20.3}, 2, 20.3)  # d is behind: its old request heals
        assert q.heal_from == {"d": "a"}
        for g in "abcd":
            book.heartbeat(g, now=29.0)
        assert self._round(book, {"a": 30.0, "b": 30.1, "c": 30.2}, 3, 31.0) is None  # d is late again: waited for
        book.ask(QuorumRequest("d", step=3, round_step=30), now=31.2)
        q = book.decide(now=31.2)
        assert q.participants == ("a", "b", "c", "d") and q.heal_from == {}

    def test_dead_or_hung_groups_still_leave_rounds_within_the_timeouts(self):
        """A longer join wait never holds a round past the heartbeat timeout: a dead group
        stops heartbeating, and a hung one that heartbeats never asks, so it is left out
        after the wait, which is at most the heartbeat timeout."""
        rules = QuorumRules(min_groups=1, join_timeout_s=0.5, heartbeat_timeout_s=3.0)
        book = QuorumBook(rules, ask_skew=[10.0])  # the measured skew is capped
        assert book.join_wait() == 3.0
        book.previous = Quorum(1, ("a", "b", "dead", "hung"), 0, {})
        for g in ("a", "b", "dead", "hung"):
            book.heartbeat(g, now=0.0)
        book.ask(QuorumRequest("a", step=1), now=1.0)
        book.ask(QuorumRequest("b", step=1), now=1.0)
        for t in (1.5, 2.0, 3.5):
            for g in ("a", "b", "hung"):  # hung: its heartbeat thread lives on; it never asks
                book.heartbeat(g, now=t)
            assert book.decide(now=t) is None
        q = book.decide(now=4.0)  # 3 s after the first ask: the dead one is stale, the hung one waited out
        assert q is not None and q.participants == ("a", "b")

    def test_the_first_rounds_start_skew_is_not_a_round_skew(self):
        book = QuorumBook(QuorumRules(min_groups=1, join_timeout_s=0.5, heartbeat_timeout_s=3.0, expected_groups=2))
        book.heartbeat("a", now=0.0)
        book.ask(QuorumRequest("a", step=0), now=0.0)
        book.heartbeat("a", now=5.9)
        book.ask(QuorumRequest("b", step=0), now=6.0)  # a slow start
        assert book.decide(now=6.0).participants == ("a", "b")
        assert book.join_wait() == 3.0  # not 2 x 6 s: the first round waits the bound, being unmeasured
        for g in "ab":
            book.heartbeat(g, now=9.0)
        book.ask(QuorumRequest("a", step=0, round_step=10), now=10.0)
        book.ask(QuorumRequest("b", step=0, round_step=10), now=10.25)
        assert book.decide(now=10.25) is not None
        assert book.join_wait() == pytest.approx(0.75)  # measured: 3 x 0.25 s

    def test_a_restarted_lighthouse_continues_above_ids_groups_have_seen(self):
        book = QuorumBook(RULES)
        book.heartbeat("g0", now=0.0, quorum_id_seen=7)
        book.heartbeat("g1", now=0.0, quorum_id_seen=6)
        book.ask(QuorumRequest("g0", step=3), now=0.0)
        book.ask(QuorumRequest("g1", step=3), now=0.0)
        assert book.decide(now=0.0).quorum_id == 8

    def test_no_quorum_that_would_fork_the_job_from_stale_state_while_a_holder_lives(self):
        """Groups that all lag the job's committed step wait for a live peer that holds it."""
        book = QuorumBook(QuorumRules(min_groups=1, join_timeout_s=1.0, heartbeat_timeout_s=2.0))
        for t in range(52):  # the holder keeps heartbeating but is slow to ask; a majority asks
            book.heartbeat("old", now=float(t), step=12)
            book.ask(QuorumRequest("a", step=0), now=float(t))
            book.ask(QuorumRequest("b", step=3), now=float(t))
            assert book.decide(now=float(t)) is None
        book.ask(QuorumRequest("old", step=12), now=52.0)
        q = book.decide(now=52.0)
        assert q.heal_from == {"a": "old", "b": "old"} and q.round_floor == 0

    def test_lost_newest_state_goes_on_from_the_best_survivor_under_higher_round_numbers(self):
        """Every holder of round 12 died: after a heartbeat timeout without one, the best
        surviving state (round 9) goes on, and its next commit is round 14: above 12 and above
        a round 13 that a holder may have committed without reporting it before it died."""
        book = QuorumBook(QuorumRules(min_groups=1, join_timeout_s=1.0, heartbeat_timeout_s=2.0))
        book.heartbeat("old", now=0.0, step=12)  # held the job's newest state, then died
        book.heartbeat("mid", now=0.0, step=9)
        for t in (1.0, 2.5, 3.5, 4.0):  # old unhealthy from 2.0: lost from 2.5, given up at 4.5
            book.ask(QuorumRequest("mid", step=9), now=t)
            book.ask(QuorumRequest("new", step=0), now=t)
            assert book.decide(now=t) is None, t
        book.ask(QuorumRequest("mid", step=9), now=4.5)
        book.ask(QuorumRequest("new", step=0), now=4.5)
        q = book.decide(now=4.5)
        assert q.participants == ("mid", "new") and q.heal_from == {"new": "mid"}
        assert q.max_step == 9 and q.round_floor == 13
        assert Quorum.from_json(q.to_json()) == q
        book.ask(QuorumRequest("mid", step=14), now=5.0)
        book.ask(QuorumRequest("new", step=14), now=5.0)
        assert book.decide(now=5.0).round_floor == 0  # back to normal above the high water
        book.heartbeat("mid", now=20.0, step=14)  # later the only holder of round 14 dies too:
        book.ask(QuorumRequest("new", step=0), now=30.0)  # a fresh wait, not the old loss's clock
        assert book.decide(now=30.0) is None and book.decide(now=31.0) is None
        book.ask(QuorumRequest("new", step=0), now=32.0)
        assert book.decide(now=32.0).round_floor == 15

    def test_a_member_that_leaves_a_round_is_gone_from_it_for_good(self):
        book = self._book()
        for g in ("g0", "g1", "g2"):
            book.ask(QuorumRequest(g, step=4), now=1.0)
        r = book.decide(now=1.0).round_id
        assert book.break_rounds(now=1.0) == {} and book.watched_round("g0") == (r, None)
        assert book.commit("g0", r, step=5, now=1.2) == "" and book.high_water == 5  # recorded at once
        for g in ("g0", "g1"):
            book.heartbeat(g, now=RULES.heartbeat_timeout_s)
        told = book.break_rounds(now=1.0 + RULES.heartbeat_timeout_s)  # g2 went silent (hung) mid-round
        assert set(told) == {"g0", "g1", "g2"} and "group g2 left round" in told["g1"] and "no heartbeat" in told["g1"]
        assert book.watched_round("g1")[1].gone == {"g2"} and book.open_rounds[r] == {"g0", "g1"}
        book.heartbeat("g2", now=12.0)  # it resumes: still gone from the round, and may not commit it
        assert "group g2 left" in book.commit("g2", r, step=5, now=13.0) and book.reported["g2"] == 4
        assert book.last_heartbeat["g2"] == 13.0, "a refused commit is a sign of life all the same"
        assert book.commit("g1", r, step=5, now=12.0) == "", "a member whose all-reduce completed commits"
        assert book.break_rounds(now=12.0) == {}, "told once"

    def test_a_departed_member_breaks_its_round_at_once_and_asking_again_leaves_a_round(self):
        book = self._book()
        for g in ("g0", "g1", "g2"):
            book.ask(QuorumRequest(g, step=1), now=1.0)
        r = book.decide(now=1.0).round_id
        book.ask(QuorumRequest("g0", step=2), now=1.1)  # g0 is done with round r
        assert book.open_rounds[r] == {"g1", "g2"}
        book.depart("g0")  # so its death breaks nothing
        assert book.break_rounds(now=1.1) == {}
        book.depart("g1")
        assert set(book.break_rounds(now=1.1)) == {"g1", "g2"} and "departed" in book.watched_round("g2")[1].reason
        book.depart("g2")
        assert book.break_rounds(now=1.1) == {"g2": book.broken[r].reason} and book.broken[r].gone == {"g1", "g2"}

    def test_a_lane_watch_follows_the_last_round_its_group_was_granted(self):
        book = self._book()
        assert book.watched_round("g0") == (0, None), "none yet (a restarted lighthouse's)"
        for g in ("g0", "g1", "g2"):
            book.ask(QuorumRequest(g, step=1), now=1.0)
        first = book.decide(now=1.0).round_id
        book.ask(QuorumRequest("g0", step=2), now=1.1)
        assert book.watched_round("g0") == (first, None), "asked again: not granted a round yet"
        for g in ("g1", "g2"):
            book.ask(QuorumRequest(g, step=2), now=1.1)
        second = book.decide(now=1.1).round_id
        assert second > first and book.watched_round("g0") == (second, None)
        book.depart("g1")
        book.break_rounds(now=1.2)
        assert book.watched_round("g0")[1].gone == {"g1"} and book.watched_round("g1")[0] == second

    def test_a_commit_of_a_round_this_lighthouse_never_formed_is_refused(self):
        book = self._book()  # a restarted lighthouse: the groups' rounds are unknown to it
        assert "not open for group g0" in book.commit("g0", 3, step=9, now=1.0) and book.high_water == 0
        assert book.last_heartbeat["g0"] == 1.0 and "g0" not in book.reported, "a heartbeat; the step is not recorded"

    def test_failed_commit_forces_a_new_id(self):
        book = self._book()
        for g in ("g0", "g1", "g2"):
            book.ask(QuorumRequest(g, step=1), now=1.0)
        first = book.decide(now=1.0)
        book.ask(QuorumRequest("g0", step=1), now=2.0)
        book.ask(QuorumRequest("g1", step=1, commit_failed=True), now=2.0)
        book.ask(QuorumRequest("g2", step=2), now=2.0)
        q = book.decide(now=2.0)
        assert q.quorum_id == first.quorum_id + 1 and q.heal_from == {"g0": "g2", "g1": "g2"}


class TestSittingOut:
    """Rounds that fail for every member, nobody dying (two groups that cannot reach each other
    while both reach the lighthouse): one asker sits out per failure past the second in a row."""

    RULES = QuorumRules(min_groups=1, join_timeout_s=5.0, heartbeat_timeout_s=1000.0, sit_out_s=60.0)

    def _round(self, book: QuorumBook, groups: list[str], now: float, failed: bool = False) -> Quorum | None:
        for g in groups:
            book.ask(QuorumRequest(g, step=book.high_water, commit_failed=failed, lane_failed=failed), now=now)
        return book.decide(now=now)

    def test_a_pair_that_cannot_meet_ends_up_apart_and_the_others_go_on(self):
        book = QuorumBook(self.RULES)
        everyone = ["g0", "g1", "g2", "g3"]  # g1 and g2 cannot reach each other
        assert self._round(book, everyone, now=0.0).participants == tuple(everyone)
        assert self._round(book, everyone, now=30.0, failed=True).participants == tuple(everyone), "one failure: again"
        q = self._round(book, everyone, now=60.0, failed=True)
        assert q.participants == ("g0", "g1", "g2") and "g3" in book.turned_away, "the last by name sits out first"
        assert "sits out rounds for 60 s" in book.turned_away["g3"]
        book.turned_away.clear()
        q = self._round(book, ["g0", "g1", "g2", "g3"], now=90.0, failed=True)
        assert q.participants == ("g0", "g1") and "sits out rounds for 30 s more" in book.turned_away["g3"]
        assert "sits out rounds for 60 s (" in book.turned_away["g2"], "still failing: one more sits out"
        assert book.decide(now=90.0) is None, "a decision tried again counts the failed round once"
        assert self._round(book, ["g0", "g1"], now=100.0).participants == ("g0", "g1"), "apart, rounds work"
        assert book.failed_in_a_row == 0
        # g3's time is up first: it comes back and works; then g2, which fails again with g1.
        q = self._round(book, ["g0", "g1", "g3"], now=121.0)
        assert q.participants == ("g0", "g1", "g3") and "g3" not in book.sitting_out
        q = self._round(book, ["g0", "g1", "g2", "g3"], now=151.0)
        assert q.participants == ("g0", "g1", "g2", "g3") and book.sat_out == {"g2": 1}
        q = self._round(book, everyone, now=181.0, failed=True)
        assert q.participants == ("g0", "g1", "g3"), "g2 came back and a round failed: it goes first, at once"
        assert "sits out rounds for 120 s (" in book.turned_away["g2"], "its time doubles"

    def test_a_failure_then_a_round_that_works_sets_nobody_out_and_two_never_go_below_one(self):
        book = QuorumBook(self.RULES)
        self._round(book, ["g0", "g1"], now=0.0)
        self._round(book, ["g0", "g1"], now=1.0, failed=True)
        self._round(book, ["g0", "g1"], now=2.0)
        assert self._round(book, ["g0", "g1"], now=3.0, failed=True).participants == ("g0", "g1")
        assert self._round(book, ["g0", "g1"], now=4.0, failed=True).participants == ("g0",)
        assert self._round(book, ["g0"], now=5.0, failed=True).participants == ("g0",), "the last one stays"

    def test_a_member_back_saying_the_lane_failed_ends_the_others_wait_and_the_round_counts_as_failed(self):
        """One side of a cut times out in its all-reduce while the other still waits for its lane
        to form (up to timeouts.connect): the first back breaks the round for the rest at once."""
        book = QuorumBook(self.RULES)
        first = self._round(book, ["g0", "g1", "g2"], now=0.0).round_id
        book.ask(QuorumRequest("g0", step=0, commit_failed=True, lane_failed=True), now=30.0)
        told = book.break_rounds(30.0)
        assert set(told) == {"g1", "g2"} and "group g0 left round 1: it gave the round up" in told["g1"]
        assert book.broken[first].gone == {"g0"} and not book.broken[first].left
        assert book.commit("g0", first, step=1, now=30.0), "the one that gave it up commits nothing of it"
        for g in ("g1", "g2"):  # told to give up, their own lanes did not fail (they were forming)
            book.ask(QuorumRequest(g, step=0, commit_failed=True), now=31.0)
        assert book.decide(now=31.0).participants == ("g0", "g1", "g2")
        assert book.failed_in_a_row == 1, "a round given up on a failed lane is a failed round, not a departure"

    def test_rounds_that_failed_on_non_finite_updates_or_a_member_that_left_set_nobody_out(self):
        book = QuorumBook(self.RULES)
        self._round(book, ["g0", "g1", "g2"], now=0.0)
        for now in (1.0, 2.0, 3.0):  # every update NaN: nobody commits, but the lanes worked
            for g in ("g0", "g1", "g2"):
                book.ask(QuorumRequest(g, step=0, commit_failed=True), now=now)
            assert book.decide(now=now).participants == ("g0", "g1", "g2")
        for now in (4.0, 5.0):  # a member left each of two rounds (the lighthouse broke them)
            assert len(self._round(book, ["g0", "g1", "g2"], now=now).participants) == 3
            book.depart("g2")
            assert book.break_rounds(now + 0.1)
            assert self._round(book, ["g0", "g1"], now=now + 0.5, failed=True).participants == ("g0", "g1")
        assert book.failed_in_a_row == 0 and not book.sitting_out


@pytest.mark.parametrize("field,value", [("min_groups", 0), ("join_timeout_s", 0.0), ("heartbeat_timeout_s", -1.0)])
def test_rules_validation_names_the_key(field, value):
    from diloco.config.base import ConfigError

    with pytest.raises(ConfigError, match="cluster"):
        QuorumRules(**{field: value}).validate()


class TestStartAndEnd:
    """A job's first quorum, a restarted lighthouse, and the end of the job (docs/design.md, invariant 7)."""

    RULES = QuorumRules(
        min_groups=1,
        join_timeout_s=1.0,
        heartbeat_timeout_s=3.0,
        expected_groups=3,
        start_timeout_s=20.0,
        end_timeout_s=60.0,
    )

    def _book(self, steps: dict[str, int], now: float = 0.0) -> QuorumBook:
        """A running job whose groups have committed ``steps`` (a quorum already formed)."""
        book = QuorumBook(self.RULES)
        for g in steps:
            book.ask(QuorumRequest(g, step=0), now=now)
        assert book.decide(now=now) is not None
        for g, step in steps.items():
            book.heartbeat(g, now=now, step=step)
        return book

    def _finish(self, book: QuorumBook, group: str, step: int, now: float) -> None:
        book.ask(QuorumRequest(group, step=step, finished=True, digest=f"d{step}"), now=now)

    def test_a_fresh_jobs_first_quorum_waits_for_every_configured_group(self):
        book = QuorumBook(self.RULES)
        book.ask(QuorumRequest("g0", step=0), now=0.0)
        book.ask(QuorumRequest("g1", step=0), now=2.0)
        assert book.decide(now=2.5) is None  # the join timeout alone would have let two go
        book.ask(QuorumRequest("g2", step=0), now=2.8)
        assert book.decide(now=2.8).participants == ("g0", "g1", "g2")

    def test_a_missing_group_delays_the_first_quorum_only_up_to_the_start_timeout(self):
        book = QuorumBook(self.RULES)
        for t in (0.0, 10.0, 19.9):
            book.ask(QuorumRequest("g0", step=0), now=t)
            book.ask(QuorumRequest("g1", step=0), now=t)
            assert book.decide(now=t) is None
        assert book.decide(now=20.0).participants == ("g0", "g1")

    def test_a_restarted_lighthouse_hears_every_group_before_forming_a_quorum(self):
        """A new process asks first; without the wait it would form a quorum alone and commit
        a round 1 unlike the job's (the holders of round 9 had not spoken yet)."""
        book = QuorumBook(self.RULES, started_at=100.0)
        book.ask(QuorumRequest("g2", step=0), now=100.1)
        book.heartbeat("g2", now=100.1, quorum_id_seen=4)
        assert book.decide(now=100.2) is None
        book.heartbeat("g0", now=100.5, quorum_id_seen=4, step=9)
        book.ask(QuorumRequest("g0", step=9), now=100.6)
        assert book.decide(now=100.6) is None  # g1 not heard yet
        book.heartbeat("g1", now=100.7, quorum_id_seen=4, step=9)
        book.ask(QuorumRequest("g1", step=9), now=100.7)
        q = book.decide(now=100.7)
        assert q.participants == ("g0", "g1", "g2") and q.heal_from == {"g2": "g0"} and q.quorum_id == 5

    def test_a_restarted_lighthouse_waits_at_most_a_heartbeat_timeout_for_a_dead_group(self):
        book = QuorumBook(self.RULES, started_at=0.0)
        for t in (0.5, 2.9, 3.0):
            for g in ("g0", "g1"):
                book.heartbeat(g, now=t, quorum_id_seen=4, step=9)
                book.ask(QuorumRequest(g, step=9), now=t)
        assert book.decide(now=2.9) is None
        assert book.decide(now=3.0).participants == ("g0", "g1")

    def test_a_straggler_heals_from_a_finished_group_in_a_closing_round(self):
        book = self._book({"g0": 10, "g1": 10, "g2": 7})
        self._finish(book, "g0", 10, now=1.0)
        self._finish(book, "g1", 10, now=1.0)
        assert book.decide(now=1.0) is None  # nobody behind asks: finished groups just wait
        book.ask(QuorumRequest("g2", step=7), now=2.0)
        q = book.decide(now=2.0)
        assert q.closing and q.participants == ("g0", "g1", "g2") and q.heal_from == {"g2": "g0"}
        assert q.max_step == 10 and q.round_floor == 0

    def test_a_restarted_group_heals_from_finished_groups_long_after_they_finished(self):
        book = self._book({"g0": 10, "g1": 10, "g2": 10})
        self._finish(book, "g2", 10, now=0.0)
        for t in range(1, 50):  # finished groups heartbeat and keep asking: they are not lost
            for g in ("g0", "g1", "g2"):
                book.heartbeat(g, now=float(t), step=10, finished=True)
            self._finish(book, "g0", 10, now=float(t))
            book.ask(QuorumRequest("g1", step=0), now=float(t))  # g1 was killed and restarted
            q = book.decide(now=float(t))
            if q is not None:
                break
        assert q.closing and q.heal_from == {"g1": "g0"} and t == 1

    def test_no_solo_round_for_a_group_level_with_finished_ones(self):
        """A group at the job's step that has not finished must not commit new rounds alone."""
        book = self._book({"g0": 10, "g1": 10, "g2": 10})
        self._finish(book, "g0", 10, now=1.0)
        self._finish(book, "g1", 10, now=1.0)
        book.ask(QuorumRequest("g2", step=10), now=1.0)
        assert book.decide(now=1.0) is None
        assert "finished" in book.turned_away["g2"] and "g2" not in book.pending
        for t in (10.0, 100.0):  # not even once the finished groups' state looks lost
            for g in ("g0", "g1"):
                book.heartbeat(g, now=t, step=10, finished=True)
            book.ask(QuorumRequest("g2", step=10), now=t)
            assert book.decide(now=t) is None

    def test_a_finished_group_behind_the_job_heals_before_the_end(self):
        """g1 had no quorum for the last round and finished one behind: it takes the final state."""
        book = self._book({"g0": 10, "g1": 9, "g2": 10})
        for g, step in (("g0", 10), ("g1", 9), ("g2", 10)):
            self._finish(book, g, step, now=1.0)
        assert book.end_of_job(now=1.0) is None  # not level yet
        q = book.decide(now=1.0)
        assert q.closing and q.heal_from == {"g1": "g0"}
        self._finish(book, "g1", 10, now=2.0)
        end = book.end_of_job(now=2.0)
        assert end == JobEnd(round=10, digest="d10", holders=("g0", "g1", "g2"))

    def test_only_groups_that_finished_with_the_final_state_hold_it_at_the_end(self):
        """Every holder saves model.pt, and a holder lost right after the end still counts as
        one that ended with the model: a group reporting another state at the top step is no holder."""
        book = self._book({"g0": 10, "g1": 10, "g2": 10})
        self._finish(book, "g0", 10, now=1.0)
        self._finish(book, "g2", 10, now=1.0)
        book.ask(QuorumRequest("g1", step=10, finished=True, digest="forked"), now=1.0)
        assert book.end_of_job(now=1.0) == JobEnd(round=10, digest="d10", holders=("g0", "g2"))

    def test_the_job_ends_only_once_every_group_finished(self):
        book = self._book({"g0": 10, "g1": 10, "g2": 4})
        self._finish(book, "g0", 10, now=1.0)
        self._finish(book, "g1", 10, now=1.0)
        book.heartbeat("g2", now=1.0, step=4)
        assert book.end_of_job(now=1.0) is None  # g2 is alive and still training
        for t in (10.0, 60.9, 61.0):  # g2 is silent (dead), but it is expected: wait, up to end_timeout
            for g in ("g0", "g1"):
                book.heartbeat(g, now=t, step=10, finished=True)
            if t < 61.0:
                assert book.end_of_job(now=t) is None, t
        end = book.end_of_job(now=61.0)  # end_timeout after the first finish
        assert end == JobEnd(round=10, digest="d10", holders=("g0", "g1"))  # g2 was left behind
        book.ask(QuorumRequest("g2", step=0), now=62.0)  # too late: nothing forms after the end
        assert book.decide(now=62.0) is None and book.end_of_job(now=62.0) is end

    def test_a_group_that_finished_apart_with_an_older_state_waits_for_the_holders_of_the_newer(self):
        """g2 sat out (or was cut off) and trained to its end first, at round 5; g0 and g1 went on
        to round 10 and still train: the job ends with their state, not g2's, however long."""
        book = self._book({"g0": 10, "g1": 10, "g2": 5})
        self._finish(book, "g2", 5, now=1.0)
        for t in (30.0, 61.0, 200.0):
            for g in ("g0", "g1"):
                book.heartbeat(g, now=t, step=10)
            book.heartbeat("g2", now=t)
            assert book.end_of_job(now=t) is None, "never with round 5 while round 10 lives"
        for g in ("g0", "g1"):
            self._finish(book, g, 10, now=201.0)
        for t in (202.0, 321.0):
            for g in ("g0", "g1", "g2"):
                book.heartbeat(g, now=t, finished=True)
        assert book.end_of_job(now=202.0) is None, "the end timeout runs from the first finish at round 10"
        assert book.end_of_job(now=321.0) == JobEnd(round=10, digest="d10", holders=("g0", "g1"))

    def test_groups_ahead_of_one_that_finished_apart_and_behind_train_on_in_rounds_of_their_own(self):
        """g2 trained apart (cut off, on a slow link) and finished first, at round 5: g0 and g1, at
        round 10, still form training rounds without it; the closing rounds come once they finish."""
        book = self._book({"g0": 10, "g1": 10, "g2": 5})
        self._finish(book, "g2", 5, now=1.0)
        for g in ("g0", "g1"):
            book.ask(QuorumRequest(g, step=10, round_step=40), now=1.0)
        q = book.decide(now=1.0)
        assert q is not None and q.participants == ("g0", "g1") and not q.closing
        assert "g2" in book.pending, "it waits for the final state, not turned away"
        for g in ("g0", "g1"):
            self._finish(book, g, 11, now=2.0)
        q = book.decide(now=2.0)
        assert q.closing and q.heal_from == {"g2": "g0"}

    def test_a_restarted_process_of_a_finished_group_trains_again(self):
        book = self._book({"g0": 10, "g1": 10, "g2": 10})
        self._finish(book, "g0", 10, now=1.0)
        book.heartbeat("g0", now=2.0, step=0)  # its new process says it is not finished
        assert "g0" not in book.finished

    def test_finished_holders_lost_then_the_best_finished_state_ends_the_job(self):
        """The only holder of round 10 died; the others finished at 9 (they missed the last
        round). After a heartbeat timeout without a holder, 9 is the job's state: the holder's
        new process heals to it, and the job ends there."""
        book = self._book({"g0": 10, "g1": 9, "g2": 9})  # g0 is never heard of again
        for t in (1.0, 3.5, 6.4):  # g0 unhealthy from 3.0: noticed at 3.5, its state given up at 6.5
            for g in ("g1", "g2"):
                self._finish(book, g, 9, now=t)
            assert book.decide(now=t) is None and book.end_of_job(now=t) is None
        book.ask(QuorumRequest("g0", step=0), now=7.0)  # restarted
        q = book.decide(now=7.0)
        assert q.closing and q.max_step == 9 and q.heal_from == {"g0": "g1"}
        for g in ("g0", "g1", "g2"):
            self._finish(book, g, 9, now=7.5)
        assert book.end_of_job(now=7.5) == JobEnd(round=9, digest="d9", holders=("g0", "g1", "g2"))
