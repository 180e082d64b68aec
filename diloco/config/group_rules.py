"""The outer recipe's rules for the number of groups M, as a job of M groups runs them.

The recipe's keys were tuned on rounds of few groups; two of them follow M by a rule
(docs/configuration.md, ``algo.*``): the mixing weight α·(N/M)² (a round of more groups averages
a less noisy Δ̄, so each group keeps less of its own θ_l), and, for top-k payloads, a kept entry
averaged over no fewer than N of the groups (four groups' top 1% coincide little, and the plain
mean would shrink each group's progress M-fold). The header says what each makes of this job's M,
as it says its warm-ups, so a job of 30 groups does not read α = 0.5 where it runs 0.0022.
"""

from __future__ import annotations

from diloco.config.algo import SYNCING
from diloco.config.job import JobConfig
from diloco.schedule import mixing_alpha


def group_alpha(job: JobConfig, groups: int | None = None) -> float:
    """α after its ramp in a round of ``groups`` groups (all the job's by default): α·min(1, (N/M)²)."""
    algo = job.algo
    return mixing_alpha(0, groups or job.cluster.groups, algo.alpha, 0, algo.alpha_reference_groups)


def group_rules_line(job: JobConfig) -> str | None:
    """One line for the job's start: what each M-rule makes of a round of every group; None where
    no rule changes anything (M at most the reference, or the rule off)."""
    algo, groups = job.algo, job.cluster.groups
    if algo.name not in SYNCING:
        return None
    said = []
    n = algo.alpha_reference_groups
    if algo.alpha and 0 < n < groups:
        said.append(
            f"α = {algo.alpha:g}·({n}/{groups})² = {group_alpha(job):.3g} in a round of all {groups} "
            f"(algo.alpha_reference_groups={n}; a round of fewer keeps more, {algo.alpha:g} at {n} or fewer)"
        )
    n = algo.sparse_reference_groups
    if algo.compress == "topk" and algo.density < 1 and 0 < n < groups:
        said.append(
            f"a kept top-k entry averaged over the groups that sent it, but over no fewer than {n} "
            f"(algo.sparse_reference_groups={n})"
        )
    if not said:
        return None
    return f"groups: {'; '.join(said)}; a key =0 turns its rule off"
