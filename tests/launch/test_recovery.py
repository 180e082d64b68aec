"""The recovery choice at a death: its costs on both sides of the threshold, the lighthouse
holding (or not) the survivors' rounds for the replacement, the planner's measurements, and
the predicted beside the actual cost in summary.json."""

from __future__ import annotations

import dataclasses
import random

import pytest

from diloco.config.cluster import LighthouseConfig, QuorumRules
from diloco.ft.client import LighthouseClient
from diloco.ft.lighthouse import Lighthouse
from diloco.ft.quorum import QuorumBook, QuorumRequest
from diloco.launch.recovery import FIRST_GUESS_READY_S, RecoveryPlanner
from diloco.launch.summary import recovery_choices, state_losses
from diloco.outer.perf_model import choose_recovery, expected_stall_seconds, recovery_costs
from diloco.run_paths import RunPaths
from tests.canned_runs import write_jsonl
from tests.conftest import compose_job


# -- the model -------------------------------------------------------------------------------
@pytest.mark.parametrize(("ready", "window"), [(0.3, 2.0), (1.5, 2.0), (3.0, 2.0)])
def test_the_expected_stall_is_the_mean_wait_of_a_held_round(ready, window):
    rng = random.Random(0)
    simulated = sum(max(0.0, ready - rng.uniform(0, window)) for _ in range(100_000)) / 100_000
    assert expected_stall_seconds(ready, window) == pytest.approx(simulated, rel=0.02)


def test_waiting_wins_while_the_replacement_is_ready_within_2w_over_1_plus_survivors():
    window, survivors = 2.0, 3
    threshold = 2 * window / (1 + survivors)
    assert choose_recovery(threshold * 0.99, window, survivors) == "wait"
    assert choose_recovery(threshold * 1.01, window, survivors) == "go_on"
    assert choose_recovery(0.03, window, survivors) == "wait", "a warm spare"
    assert choose_recovery(1.2, window, survivors) == "go_on", "fresh workers after a 1 s backoff"
    # ready 0.5 of W 2: it idles (1.5)²/4 when it is early, 3 survivors stall 0.5²/4 each when it is late
    assert recovery_costs(0.5, 2.0, 3) == {"wait": 0.5 + 0.5625 + 3 * 0.0625, "go_on": 1.5}
    assert recovery_costs(3.0, 2.0, 3) == {"wait": 3.0 + 0.0 + 3 * 2.0, "go_on": 4.0}, "ready after the window"


def test_the_modelled_costs_match_a_simulation_of_both_options():
    rng = random.Random(1)
    ready, window, survivors, n = 0.7, 2.0, 3, 100_000
    wait = go_on = 0.0
    for _ in range(n):
        u = rng.uniform(0, window)
        wait += ready + max(0.0, u - ready) + survivors * max(0.0, ready - u)
        go_on += ready + ((u - ready) if u >= ready else (u + window - ready))
    costs = recovery_costs(ready, window, survivors)
    assert costs["wait"] == pytest.approx(wait / n, rel=0.01) and costs["go_on"] == pytest.approx(go_on / n, rel=0.01)


# -- the lighthouse's rules --------------------------------------------------------------------
RULES = QuorumRules(min_groups=1, join_timeout_s=0.5, heartbeat_timeout_s=10.0)


def _three_groups_one_dead() -> QuorumBook:
    """a, b and c formed a round; c died at 1.0 (its last heartbeat), a and b ask again at 2.0."""
    book = QuorumBook(RULES)
    for g in "abc":
        book.ask(QuorumRequest(g, step=1), now=0.0)
    assert book.decide(now=0.0).participants == ("a", "b", "c")
    book.heartbeat("c", now=1.0)
    for g in "ab":
        book.ask(QuorumRequest(g, step=2), now=2.0)
    return book


def test_by_default_the_survivors_wait_the_join_timeout_for_a_dead_group():
    book = _three_groups_one_dead()
    assert book.decide(now=2.4) is None
    assert book.decide(now=2.5).participants == ("a", "b")


def test_going_on_the_survivors_do_not_wait_at_all():
    book = _three_groups_one_dead()
    book.depart("c")
    assert book.decide(now=2.0).participants == ("a", "b")
    book.heartbeat("c", now=3.0)  # its replacement is back: waited for again
    assert "c" in book.healthy(now=3.0)


def test_waiting_holds_the_round_past_the_join_timeout_until_the_replacement_asks():
    book = _three_groups_one_dead()
    book.await_return("c", now=1.0, wait_s=3.0)
    assert book.decide(now=2.5) is None and book.decide(now=3.9) is None
    book.ask(QuorumRequest("c", step=0), now=3.9)
    q = book.decide(now=3.9)
    assert q.participants == ("a", "b", "c") and q.heal_from == {"c": "a"}


def test_a_replacement_that_does_not_come_in_time_is_given_up_at_the_bound():
    book = _three_groups_one_dead()
    book.await_return("c", now=1.0, wait_s=3.0)
    assert book.decide(now=3.99) is None
    assert book.decide(now=4.0).participants == ("a", "b"), "no sign of life: c departs"
    assert "c" not in book.healthy(now=4.0)


def test_a_replacement_alive_but_late_at_the_bound_is_left_to_the_join_rule():
    book = _three_groups_one_dead()
    book.await_return("c", now=1.0, wait_s=3.0)
    book.heartbeat("c", now=3.5)  # its first heartbeat: it will ask soon
    assert book.decide(now=4.0).participants == ("a", "b"), "the join timeout has passed long ago"
    assert "c" in book.healthy(now=4.0)


# -- the planner ---------------------------------------------------------------------------------
def healthy(lighthouse: Lighthouse) -> set[str]:
    """The groups the lighthouse counts as alive, as its /status shows them."""
    return {g["id"] for g in lighthouse.status()["groups"] if g["healthy"]}


def test_the_planner_measures_the_window_learns_start_times_and_tells_the_lighthouse(tmp_path):
    job = compose_job(["logger=none", "cluster.groups=3"])
    paths = RunPaths(tmp_path)
    write_jsonl(paths.commits(0), [{"time": float(t), "committed": True} for t in (10, 12, 14, 16)])
    write_jsonl(paths.commits(2), [{"time": float(t), "committed": True} for t in (11, 13, 15, 17)])
    rules = QuorumRules(min_groups=1, join_timeout_s=0.5, heartbeat_timeout_s=10.0)
    with Lighthouse(LighthouseConfig(port=0), rules, job.name) as lighthouse:
        cluster = dataclasses.replace(job.cluster, lighthouse=LighthouseConfig(port=lighthouse.port))
        job = dataclasses.replace(job, cluster=cluster)
        client = LighthouseClient(
            lighthouse.url, token="", job_id=job.name, signature="sig", group="group1", connect_timeout_s=5
        )
        client.heartbeat(0, 0)
        assert "group1" in healthy(lighthouse)
        planner = RecoveryPlanner(job, paths, "sig")
        fresh = planner.plan(1, 20.0, spare=False, delay_s=1.0, alive=[0, 1, 2])
        assert fresh["window_s"] == 2.0 and fresh["survivors"] == 2 and fresh["replacement"] == "fork"
        assert fresh["ready_s"] == 1.0 + FIRST_GUESS_READY_S["fork"] and fresh["lighthouse_told"]
        assert fresh["choice"] == "go_on" and fresh["wait_s"] == 0.0  # 1.5 s > 2 / √2
        assert "group1" not in healthy(lighthouse), "gone: rounds stop waiting for it"
        write_jsonl(paths.commits(1), [{"time": 21.5, "asked_at": 21.3, "committed": False}])
        spare = planner.plan(1, 30.0, spare=True, delay_s=0.0, alive=[0, 2])
        assert planner.measured["fork"] == [pytest.approx(0.3)], "asked 1.3 s after the death, 1 s of it backoff"
        assert spare["choice"] == "wait" and spare["wait_s"] == pytest.approx(0.1 + job.cluster.timeouts.recovery)
        assert lighthouse.awaits_replacement("group1")
    forced = RecoveryPlanner(compose_job(["logger=none", "cluster.recovery=wait"]), paths, "sig")
    told = forced.plan(1, 40.0, spare=False, delay_s=1.0, alive=[0, 2])
    assert told["choice"] == "wait" and not told["lighthouse_told"], "no lighthouse there: told nothing"


def test_the_summary_sets_the_actual_cost_beside_the_predicted_one():
    events = [
        {"kind": "kill", "group": 1, "time": 100.0},
        {
            "kind": "plan",
            "group": 1,
            "time": 100.0,
            "choice": "go_on",
            "survivors": 2,
            "predicted": {"wait": 2.5, "go_on": 2.0},
        },
    ]
    commits = {
        0: [{"time": t, "committed": True, "sync_ms": ms} for t, ms in ((99.0, 100.0), (101.0, 300.0), (103.0, 100.0))],
        2: [{"time": t, "committed": True, "sync_ms": 100.0} for t in (99.0, 101.0, 103.0)],
        1: [
            {"time": 101.5, "committed": False, "join": True, "sync_ms": 50.0},
            {"time": 103.0, "committed": True, "sync_ms": 100.0},
        ],
    }
    [choice] = recovery_choices(events, commits)
    # gone 103.0 − 100.0 − 0.1 = 2.9 s; survivors' stall: group 0 0.2 s extra, group 2 none: 0.1 s each.
    assert choice == {"choice": "go_on", "predicted": 2.0, "actual": pytest.approx(2.9 + 2 * 0.1)}


def test_the_summary_counts_each_loss_of_the_newest_state_once_with_the_steps_to_train_again():
    def committed(round_, step, t, quorum, floor=0):
        return {
            "round": round_,
            "inner_step": step,
            "time": t,
            "quorum_id": quorum,
            "round_floor": floor,
            "committed": True,
        }

    commits = {  # both groups died after round 2 (step 20); a survivor of step 10 went on, rounds numbered from 4
        0: [committed(1, 10, 1.0, 2), committed(2, 20, 2.0, 3), committed(4, 10, 9.0, 5, floor=3)],
        1: [committed(1, 10, 1.1, 2), committed(4, 10, 9.1, 5, floor=3), committed(5, 20, 10.0, 6)],
    }
    assert state_losses(commits) == [{"lost_round": 2, "lost_step": 20, "went_on_from_step": 10}]
    assert state_losses({0: commits[0][:2], 1: commits[1][:1]}) == []  # no quorum after a loss: none
    old_records = {0: [{k: v for k, v in r.items() if k != "round_floor"} for r in commits[0]]}
    assert state_losses(old_records) == []  # commit logs written before round_floor was recorded
