"""summary.json's ``lost_work``: the global model's step against trainer.max_steps, and each group's
inner steps that no commit carries, from the result records and commit logs a job leaves."""

from __future__ import annotations

from diloco.launch.header import group_step_tokens
from diloco.launch.summary import (
    earlier_processes_tokens,
    event_counts,
    group_steps_lost,
    heals_per_group,
    lost_work,
    steps_no_commit_carries,
)
from tests.canned_runs import commit_record
from tests.conftest import compose_job

JOB = compose_job(["trainer.max_steps=1500", "algo.sync_every=30"])
STEP = group_step_tokens(JOB)


def commit(round_: int, step: int, steps_carried: float, pid: int = 7, **extra) -> dict:
    return commit_record(round_, float(step), pid, "d", inner_step=step, tokens=steps_carried * STEP, **extra)


def rounds(last_step: int, pid: int = 7, start: int = 0) -> list[dict]:
    """A process's join round at ``start``, then a committed round every 30 steps up to ``last_step``."""
    join = commit(start // 30, start, 0, pid, committed=False, join=True)
    return [join] + [commit(step // 30, step, 30, pid) for step in range(start + 30, last_step + 1, 30)]


def result(group: int, trained_steps: int, resumed_steps: int = 0) -> dict:
    tokens = {"tokens_seen": (resumed_steps + trained_steps) * STEP, "resumed_tokens": resumed_steps * STEP}
    return {"group": group, "steps": JOB.trainer.max_steps} | tokens


def test_a_step_counts_as_carried_once_whichever_windows_carry_it():
    assert steps_no_commit_carries(100, [(0, 10), (10, 20)]) == 80
    assert steps_no_commit_carries(20, [(0, 10), (5, 15), (10, 20)]) == 0  # streaming: fragments' windows overlap
    assert steps_no_commit_carries(20, [(0, 10), (20, 20)]) == 10  # a heal's commit carries no step of its own
    assert steps_no_commit_carries(10, [(0, 10), (0, 10)]) == 0


def test_groups_that_trained_apart_after_round_12_lost_every_step_since():
    """Rounds stopped forming at step 360 of 1,500 (a network cut); each group trained on alone
    to the last step, and the job ends ok on the round-12 global model."""
    commits = {0: rounds(360), 1: rounds(360)}
    assert lost_work(JOB, [result(0, 1500), result(1, 1500)], commits, final_round=12) == {
        "global_step": 360,
        "max_steps": 1500,
        "steps_short": 1140,
        "per_group": {"0": 1140, "1": 1140},
        "group_steps_lost": 2280,
    }
    closing = commit(12, 1500, 0, committed=False, closing=True)
    assert lost_work(JOB, [result(0, 1500)], {0: rounds(360) + [closing]}, final_round=None)["global_step"] == 360


def test_a_fault_free_diloco_streaming_or_ddp_job_loses_nothing():
    diloco = {g: rounds(1500) for g in (0, 1)}
    assert lost_work(JOB, [result(0, 1500), result(1, 1500)], diloco, final_round=50)["group_steps_lost"] == 0
    # P = 2: fragment 0 syncs at 15, 45, ..., 1485 and fragment 1 at 30, ..., 1500, each commit carrying
    # half its window's tokens; fragment 0's last 15 steps reach the model only through fragment 1's round.
    fragment_0 = [commit(0, step, min(step, 30) / 2) for step in range(15, 1500, 30)]
    fragment_1 = [commit(0, step, 30 / 2) for step in range(30, 1501, 30)]
    streamed = sorted(fragment_0 + fragment_1, key=lambda r: r["inner_step"])
    assert group_steps_lost(result(0, 1500), streamed, STEP, fragments=2) == 0
    assert group_steps_lost(result(0, 1500), streamed[:-1], STEP, fragments=2) == 15
    ddp = compose_job(["trainer.max_steps=1500", "algo=ddp"])
    every_step = {0: [commit(step, step, 1) for step in range(1, 1501)]}
    summary = lost_work(ddp, [result(0, 1500)], every_step, final_round=1500)
    assert (summary["global_step"], summary["steps_short"], summary["group_steps_lost"]) == (1500, 0, 0)


def test_a_round_that_failed_loses_its_window_and_a_heal_the_steps_before_it():
    failed = rounds(300)
    failed[5] |= {"committed": False, "tokens": 0.0}  # the window ending at step 150 reached no model
    assert group_steps_lost(result(0, 300), failed, STEP, fragments=1) == 30
    # Trained steps 1-130, healed to 270 (its own 121-130 thrown away), trained on to 300.
    healed = rounds(120) + [commit(9, 270, 0, healed=True)] + rounds(300, start=270)[1:]
    assert group_steps_lost(result(0, 160), healed, STEP, fragments=1) == 10
    assert group_steps_lost(result(0, 300), [], STEP, fragments=1) == 300, "never in a round: all of it"


def test_only_the_process_that_wrote_the_result_counts_and_no_steps_before_its_checkpoint():
    """A killed process committed up to step 300; its replacement healed to 300 and trained the
    last 1,200 steps, the last 30 of them in a round that failed (an earlier process's commits
    would hide them). A resumed process's 120 steps before its checkpoint are no work of this run."""
    killed, replacement = rounds(300, pid=1), rounds(1470, pid=2, start=300)
    assert group_steps_lost(result(0, 1200), killed + replacement, STEP, fragments=1) == 30
    resumed = rounds(1500, pid=3, start=120)
    assert group_steps_lost(result(0, 1380, resumed_steps=120), resumed, STEP, fragments=1) == 0


def test_algo_local_has_no_global_model_to_fall_short_of():
    local = compose_job(["trainer.max_steps=1500", "algo=local"])
    summary = lost_work(local, [result(0, 1500), result(1, 1500)], {0: [], 1: []}, final_round=None)
    assert (summary["steps_short"], summary["per_group"], summary["group_steps_lost"]) == (0, {"0": 0, "1": 0}, 0)


def test_a_groups_heals_add_up_over_its_processes_and_its_results_file():
    """Each process counts its own heals from 0: the per-group figures add up to the job's."""
    commits = {
        0: [{"pid": 10, "recoveries": 0}],
        1: [{"pid": 20, "recoveries": 0}, {"pid": 21, "recoveries": 1}, {"pid": 22, "recoveries": 1}],
        2: [{"pid": 30, "recoveries": 1}],
    }
    results = [{"group": 1, "recoveries": 1}, {"group": 2, "recoveries": 2}]  # group 2 healed once more at the end
    assert heals_per_group(commits, results) == {0: 0, 1: 2, 2: 2}


def test_without_a_launchers_events_the_restarts_are_the_processes_the_commit_logs_show():
    commits = {0: [{"pid": 10}, {"pid": 11}, {"pid": 11}], 1: [{"pid": 20}]}
    assert event_counts([], commits) == {"restart": 1}
    assert event_counts([], {0: [{"pid": 10}]}) == {}
    assert event_counts([{"kind": "kill"}, {"kind": "restart"}, {"kind": "kill"}], commits) == {"kill": 2, "restart": 1}


def test_a_restarted_groups_earlier_processes_count_the_tokens_their_commits_carry():
    """Its result counts the last process's steps; the killed one's committed rounds trained too."""
    commits = {
        0: [{"pid": 10, "committed": True, "tokens": 20.0}, {"pid": 10, "committed": True, "tokens": 20.0}],
        1: [
            {"pid": 20, "committed": True, "tokens": 20.0},
            {"pid": 20, "committed": False, "tokens": 20.0},  # a failed round: none of it carried
            {"pid": 21, "committed": True, "tokens": 20.0},
        ],
        2: [{"pid": 30, "committed": True, "tokens": 5.0}],  # wrote no result: all of it is earlier work
    }
    results = [{"group": 0, "pid": 10}, {"group": 1, "pid": 21}]
    assert earlier_processes_tokens(commits, results) == 25.0
