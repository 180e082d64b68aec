"""An honest outcome: is the saved model the trained global model every group agrees on?

docs/design.md, invariant 6. Pure functions over the result records the groups' leaders write (see
``worker.run_worker``): the local launcher judges the whole job, a multi-host group judges
its own part. Any problem is a one-line reason; a job with a reason exits non-zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from diloco.config.cluster import group_name

SHOWN_DIGEST_CHARS = 12
# How far above the loss of guessing uniformly a final model may evaluate before it counts as
# diverged: an untrained model scores about that loss, and a job of a few steps stays near it.
WORSE_THAN_UNIFORM_NATS = 0.5


@dataclass(frozen=True)
class Outcome:
    """The job's verdict; ``final_round`` is that of the model the job saved, ``saved_by`` the groups
    that saved it, ``lost_after_end`` the holders of the final state that died before writing a result."""

    failure: str | None
    final_round: int | None = None
    saved_by: tuple[int, ...] = ()
    lost_after_end: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failure is None


def job_outcome(results: list[dict[str, Any]], groups: int, algo: str, model_saved: bool) -> Outcome:
    """Judge a whole local job from its groups' results.

    A group without a result fails the job, unless the lighthouse named it a holder of the
    final state at the job's end: it ended holding the model (its digest was checked), and
    died only afterwards, before it could write its result; another holder saved the model.
    """
    problems = []
    end = next((r["end"] for r in results if r.get("end")), None)
    reported = {r["group"] for r in results}
    held_at_end = {g for g in range(groups) if end and group_name(g) in end["holders"]}
    missing = sorted(set(range(groups)) - reported - held_at_end)
    if missing:
        problems.append(f"group(s) {_ids(missing)} wrote no result (died, stopped or refused before the job's end)")
    if not model_saved:
        problems.append("no group saved model.pt")
    problems += [p for r in results if (p := group_outcome(r, algo)) is not None]
    if algo == "local":  # groups never sync: each one's model is its own, by design
        return Outcome("; ".join(problems) or None)
    if results and all(r.get("rounds") and r.get("diverged_updates") for r in results):
        last = max(r["rounds"] for r in results)
        in_a_row = min(r["diverged_updates"] for r in results)
        problems.append(
            f"training diverged: the last {in_a_row} update(s) of every group were non-finite (NaN or inf), so "
            f"nothing was committed after round {last} and model.pt holds that round's model, not a trained "
            "one: lower inner_opt.lr or set inner_opt.grad_clip"
        )
    digests = {r.get("digest") for r in results}
    if len(digests) > 1:
        held = ", ".join(f"group {r['group']} round {r.get('rounds')} {_short(r.get('digest'))}" for r in results)
        problems.append(f"the groups' final global states differ: {held}")
    return Outcome(
        "; ".join(problems) or None,
        final_round=end["round"] if end else None,
        saved_by=tuple(sorted(r["group"] for r in results if r.get("saved_model"))),
        lost_after_end=tuple(sorted(held_at_end - reported)),
    )


def group_outcome(result: dict[str, Any], algo: str) -> str | None:
    """What is wrong with one group's result, if anything (also what a multi-host group checks alone)."""
    group = result["group"]
    loss = result.get("final_eval_loss")
    if loss is not None and not math.isfinite(loss):
        return f"group {group}'s final model evaluates to a loss of {loss}: training diverged"
    uniform = result.get("uniform_loss")
    if loss is not None and uniform is not None and loss > uniform + WORSE_THAN_UNIFORM_NATS:
        return (
            f"group {group}'s final model evaluates to a loss of {loss:.3f}, worse than the {uniform:.3f} of "
            "guessing every token equally likely: training diverged (lower inner_opt.lr or set inner_opt.grad_clip)"
        )
    if algo == "local":
        return None
    if not result.get("rounds"):
        if (nonfinite := result.get("nonfinite_updates", 0)) and nonfinite == result.get("syncs_attempted"):
            return (
                f"group {group} never committed an outer round: all {nonfinite} of its updates were non-finite "
                "(NaN or inf: training diverged; lower inner_opt.lr or set inner_opt.grad_clip)"
            )
        return f"group {group} never committed an outer round: its model is not the product of any sync"
    end = result.get("end")
    if end is None:
        return f"group {group} did not learn the job's end from the lighthouse"
    if end["digest"] != result.get("digest"):
        return (
            f"group {group} ends with global state {_short(result.get('digest'))} at round {result.get('rounds')}, "
            f"but the job's final state (round {end['round']}, held by {', '.join(end['holders'])}) is "
            f"{_short(end['digest'])}"
        )
    return None


def _ids(groups: list[int]) -> str:
    return ", ".join(map(str, groups))


def _short(digest: str | None) -> str:
    return "(none)" if not digest else digest[:SHOWN_DIGEST_CHARS]
