"""The honest outcome (docs/design.md, invariant 6): each way a job can end badly has its one-line reason."""

from __future__ import annotations

from diloco.launch.outcome import group_outcome, job_outcome

END = {"round": 12, "digest": "aaaa" * 16, "holders": ["group0", "group1", "group2"]}


def result(group: int, rounds: int = 12, digest: str = END["digest"], end: dict | None = END) -> dict:
    return {"group": group, "rounds": rounds, "digest": digest, "end": end, "saved_model": end is not None}


def test_every_group_holding_the_saved_final_state_is_a_success():
    outcome = job_outcome([result(0), result(1), result(2)], groups=3, algo="streaming", model_saved=True)
    assert outcome.ok and outcome.failure is None
    assert (outcome.final_round, outcome.saved_by, outcome.lost_after_end) == (12, (0, 1, 2), ())


def test_a_group_without_a_result_fails_the_job():
    end = END | {"holders": ["group0", "group2"]}
    outcome = job_outcome([result(0, end=end), result(2, end=end)], groups=3, algo="diloco", model_saved=True)
    assert outcome.failure == "group(s) 1 wrote no result (died, stopped or refused before the job's end)"


def test_a_holder_of_the_final_state_lost_right_after_the_end_is_no_failure():
    """The lighthouse saw group 1 finish with the final digest; it died before writing its result,
    and the other holders saved the model (a race at the job's end)."""
    outcome = job_outcome([result(0), result(2)], groups=3, algo="streaming", model_saved=True)
    assert outcome.ok, outcome.failure
    assert (outcome.saved_by, outcome.lost_after_end) == ((0, 2), (1,))
    alone = job_outcome([result(0)], groups=3, algo="streaming", model_saved=False)
    assert alone.failure == "no group saved model.pt"


def test_a_model_no_round_produced_fails_the_job():
    never = result(1, rounds=0, digest="b" * 64, end=None)
    outcome = job_outcome([result(0), never], groups=2, algo="diloco", model_saved=True)
    assert "group 1 never committed an outer round: its model is not the product of any sync" in outcome.failure
    assert "the groups' final global states differ: group 0 round 12 aaaaaaaaaaaa, group 1 round 0 bbbbbbbbbbbb" in (
        outcome.failure
    )
    assert "\n" not in outcome.failure


def test_a_group_whose_every_update_was_non_finite_is_told_it_diverged():
    diverged = result(0, rounds=0, end=None) | {"syncs_attempted": 4, "nonfinite_updates": 4}
    assert group_outcome(diverged, "diloco") == (
        "group 0 never committed an outer round: all 4 of its updates were non-finite "
        "(NaN or inf: training diverged; lower inner_opt.lr or set inner_opt.grad_clip)"
    )
    some = diverged | {"nonfinite_updates": 3}  # one finite update that found no quorum: not divergence
    assert group_outcome(some, "diloco") == (
        "group 0 never committed an outer round: its model is not the product of any sync"
    )


def test_every_group_ending_on_non_finite_updates_fails_the_job_as_diverged():
    diverged = [result(g) | {"diverged_updates": 3 + g} for g in range(2)]
    outcome = job_outcome(diverged, groups=2, algo="diloco", model_saved=True)
    assert outcome.failure == (
        "training diverged: the last 3 update(s) of every group were non-finite (NaN or inf), so nothing was "
        "committed after round 12 and model.pt holds that round's model, not a trained one: lower inner_opt.lr "
        "or set inner_opt.grad_clip"
    )
    one_healthy = [diverged[0], result(1) | {"diverged_updates": 0}]  # its updates went on into the rounds
    assert job_outcome(one_healthy, groups=2, algo="diloco", model_saved=True).ok


def test_a_final_model_worse_than_guessing_uniformly_is_diverged_training():
    uniform = 5.545177444479562  # ln 256
    blown_up = result(1) | {"final_eval_loss": 12.05, "uniform_loss": uniform}
    assert group_outcome(blown_up, "local") == (
        "group 1's final model evaluates to a loss of 12.050, worse than the 5.545 of guessing every token "
        "equally likely: training diverged (lower inner_opt.lr or set inner_opt.grad_clip)"
    )
    barely_trained = blown_up | {"final_eval_loss": uniform + 0.3}  # a few steps from an untrained start: no verdict
    assert group_outcome(barely_trained, "diloco") is None


def test_final_digests_that_disagree_fail_the_job():
    fork = result(2, rounds=14, digest="c" * 64)
    outcome = job_outcome([result(0), result(1), fork], groups=3, algo="ddp", model_saved=True)
    assert not outcome.ok
    assert "group 2 ends with global state cccccccccccc at round 14, but the job's final state (round 12" in (
        outcome.failure
    )


def test_no_saved_model_fails_the_job():
    assert job_outcome([result(0)], groups=1, algo="diloco", model_saved=False).failure == "no group saved model.pt"


def test_groups_that_never_sync_by_design_are_judged_only_on_their_results():
    alone = [result(0, rounds=0, digest=None, end=None), result(1, rounds=0, digest=None, end=None)]
    assert job_outcome(alone, groups=2, algo="local", model_saved=True).ok
    assert group_outcome(alone[0], "local") is None


def test_a_diverged_final_model_fails_the_job_whatever_the_algorithm():
    for algo in ("local", "diloco"):
        diverged = result(0) | {"final_eval_loss": float("nan")}
        outcome = job_outcome([diverged], groups=1, algo=algo, model_saved=True)
        assert outcome.failure == "group 0's final model evaluates to a loss of nan: training diverged"


def test_a_multi_host_group_judges_its_own_part():
    assert group_outcome(result(1), "diloco") is None
    assert "did not learn the job's end" in group_outcome(result(1, end=None), "diloco")
