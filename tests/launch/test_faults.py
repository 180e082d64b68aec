"""The fault plan and where a kill lands: pure functions of plain numbers; a worker's fault hook."""

from __future__ import annotations

import pytest

from diloco.config.base import ConfigError
from diloco.config.faults import FaultsConfig
from diloco.ft.fault_requests import FaultHook, request_fault
from diloco.launch.faults import fault_target, kill_target, plan_faults
from tests.conftest import compose_job


def test_the_same_seed_gives_the_same_plan_in_time_order():
    cfg = FaultsConfig(seed=4, start_after=10.0, kill_every=5.0, hang_every=7.0, nan_every=11.0)
    plan = plan_faults(cfg, groups=4, horizon_s=60.0)
    assert plan == plan_faults(cfg, groups=4, horizon_s=60.0)
    assert [e.at for e in plan] == sorted(e.at for e in plan)
    kills = [e.group for e in plan if e.kind == "kill"]
    assert len(kills) == 11 and all(a != b for a, b in zip(kills, kills[1:]))  # never the same group twice in a row


def test_no_faults_after_stop_after():
    plan = plan_faults(FaultsConfig(start_after=1.0, stop_after=20.0, kill_every=2.0), groups=3, horizon_s=1000.0)
    assert plan and max(e.at for e in plan) <= 20.0


def test_a_kill_hits_the_planned_group_when_it_may():
    assert kill_target(2, up={0, 1, 2, 3}, holders={0, 1, 2, 3}, min_alive=2, groups=4) == 2


def test_a_kill_goes_to_the_next_group_when_the_planned_one_is_down():
    assert kill_target(1, up={0, 2, 3}, holders={0, 2, 3}, min_alive=0, groups=4) == 2
    assert kill_target(3, up={0, 1, 2}, holders={0, 1, 2}, min_alive=0, groups=4) == 0  # wraps around


def test_a_hang_or_nan_goes_to_the_next_group_up_when_the_planned_one_is_down_or_hung():
    """A launcher late to its first pass fires the first kill, hang and NaN at once: the NaN
    planned for the group just killed, and the group just hung, goes to the next one up."""
    assert fault_target(0, up={0, 1, 2}, groups=3) == 0
    assert fault_target(0, up={2}, groups=3) == 2
    assert fault_target(2, up={0, 1}, groups=3) == 0  # wraps around
    assert fault_target(1, up=set(), groups=3) is None


def test_a_kill_hits_a_group_holding_the_state_before_one_still_taking_it():
    assert kill_target(1, up={0, 1, 2, 3}, holders={0, 2, 3}, min_alive=2, groups=4) == 2
    assert kill_target(1, up={0, 1, 2}, holders={0, 2}, min_alive=2, groups=4) == 1  # no holder may die: 1 is hit


def test_a_kill_never_leaves_fewer_than_min_alive_other_groups_holding_the_state():
    # Groups 2 and 3 are restarting (up, but they have not healed yet): only 0 and 1 hold the state.
    assert kill_target(0, up={0, 1, 2, 3}, holders={0, 1}, min_alive=2, groups=4) == 2
    assert kill_target(0, up={0, 1}, holders={0, 1}, min_alive=2, groups=4) is None
    assert kill_target(0, up={0, 1, 2}, holders={0, 1, 2}, min_alive=2, groups=4) == 0


def test_min_alive_must_not_be_negative():
    with pytest.raises(ConfigError, match="faults.min_alive=-1"):
        FaultsConfig(min_alive=-1).validate()


def test_fault_settings_under_which_no_fault_could_happen_are_refused_instead_of_a_quiet_fault_free_run():
    compose_job(["faults=kill_every", "faults.min_alive=1", "cluster.groups=2"])
    compose_job(["faults.min_alive=5", "cluster.groups=2"])  # no kills planned: nothing to hold back
    with pytest.raises(ConfigError, match=r"faults.min_alive=2: must be < cluster.groups=2 with faults.kill_every"):
        compose_job(["faults=soak", "cluster.groups=2"])
    with pytest.raises(ConfigError, match=r"faults.stop_after=10.0: must be 0 \(until the job ends\) or >"):
        compose_job(["faults=kill_every", "faults.start_after=20", "faults.stop_after=10"])


def test_workers_read_fault_requests_only_when_the_job_injects_faults_into_them():
    assert not FaultsConfig().in_workers
    assert not FaultsConfig(kill_every=5.0, hang_every=5.0, restart_lighthouse_every=5.0).in_workers
    assert FaultsConfig(nan_every=5.0).in_workers and FaultsConfig(break_lane_every=5.0).in_workers
    assert FaultsConfig(accept_requests=True).in_workers


def test_a_requested_fault_hits_once_at_a_round_after_the_request(tmp_path):
    path = tmp_path / "group0"
    path.write_text("nan 100.0\n")  # before this process started (at 150): meant for an earlier one
    hook = FaultHook(path, since=150.0, group="group0")
    with path.open("a") as fh:
        fh.write("fail_round 200.0\n")
    assert not hook.take("fail_round"), "a request reaches a worker only when a round starts"
    hook.poll()
    assert not hook.take("nan")
    assert hook.take("fail_round") and not hook.take("fail_round")
    hook.poll()  # nothing new: nothing queued again
    assert not hook.take("fail_round")


def test_an_unknown_requested_fault_is_refused(tmp_path):
    path = tmp_path / "group0"
    request_fault(path, "meteor")
    with pytest.raises(ValueError, match="unknown fault 'meteor'"):
        FaultHook(path, since=0.0, group="group0").poll()
