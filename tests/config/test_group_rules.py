"""The outer recipe's rules for the number of groups M, as the job's header states them
(diloco/config/group_rules.py)."""

import pytest

from diloco.config.group_rules import group_alpha, group_rules_line
from diloco.config.job import job_config_from_dict
from diloco.config.warmups import warmup_line


def job(groups, **algo):
    return job_config_from_dict({"cluster": {"groups": groups}, "algo": algo})


@pytest.mark.parametrize(("groups", "alpha"), [(1, 0.5), (2, 0.5), (4, 0.125), (8, 0.03125), (16, 0.5 / 64)])
def test_alpha_is_scaled_by_the_square_of_the_reference_over_m(groups, alpha):
    assert group_alpha(job(groups)) == alpha
    assert group_alpha(job(groups, alpha_reference_groups=4)) == min(0.5, 0.5 * (4 / groups) ** 2)
    assert group_alpha(job(groups, alpha_reference_groups=0)) == 0.5, "=0: α whatever M"


def test_a_round_of_fewer_groups_than_the_job_keeps_more_of_its_own():
    assert group_alpha(job(8), groups=4) == 0.125 and group_alpha(job(8), groups=2) == 0.5


def test_the_header_says_what_each_rule_makes_of_the_jobs_m_and_the_warm_up_ramps_to_it():
    line = group_rules_line(job(8))
    assert line == (
        "groups: α = 0.5·(2/8)² = 0.0312 in a round of all 8 (algo.alpha_reference_groups=2; a round of fewer "
        "keeps more, 0.5 at 2 or fewer); a key =0 turns its rule off"
    )
    assert "α rising from 0 to 0.0312 over" in warmup_line(job(8))
    sparse = group_rules_line(job(4, compress="topk", alpha=0))
    assert sparse == (
        "groups: a kept top-k entry averaged over the groups that sent it, but over no fewer than 2 "
        "(algo.sparse_reference_groups=2); a key =0 turns its rule off"
    ), "α = 0: no α rule to state"


@pytest.mark.parametrize(
    "case",
    [
        job(2),  # M at the reference
        job(8, alpha_reference_groups=0),
        job(8, alpha_reference_groups=8),
        job(8, name="ddp", sync_every=1),  # no outer rounds
        job(8, alpha=0, compress="topk", density=1.0),  # density 1 is the plain mean anyway
        job(8, alpha=0, compress="topk", sparse_reference_groups=0),
    ],
)
def test_no_line_where_no_rule_changes_anything(case):
    assert group_rules_line(case) is None
