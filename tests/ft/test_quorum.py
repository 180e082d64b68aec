"""Quorum rules as pure functions: time is a number the test chooses."""

from __future__ import annotations

import pytest

from diloco.ft.quorum import (
    Quorum,
    QuorumBook,
    QuorumRequest,
    QuorumRules,
    assign_healing,
    healthy_groups,
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


def test_healing_sources_are_up_to_date_peers_spread_evenly():
    heal = assign_healing({"a": 10, "b": 10, "c": 7, "d": 0, "e": 9, "f": 10})
    assert heal == {"c": "a", "d": "b", "e": "f"}
    assert assign_healing({"a": 3, "b": 3}) == {}


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
        assert q == Quorum(1, ("g0", "g1", "g2"), 5, {"g1": "g0"})
        assert book.pending == {} and book.decide(now=1.6) is None

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


@pytest.mark.parametrize("field,value", [("min_groups", 0), ("join_timeout_s", 0.0), ("heartbeat_timeout_s", -1.0)])
def test_rules_validation_names_the_key(field, value):
    from diloco.config_base import ConfigError

    with pytest.raises(ConfigError, match="cluster"):
        QuorumRules(**{field: value}).validate()
