"""The bandwidth each method needs for 95% compute utilization at 1B, 10B and 100B parameters,
from the performance model (diloco/outer/perf_model.py), beside the Streaming DiLoCo paper's Table 4.

    python -m experiments.parallelism.simulate_scale [--utilization 0.95] [--groups 2]

The model's absolute numbers scale with 1/step time, which the paper does not restate with
its table; so each size's step time is calibrated once, such that data parallel needs the
paper's bandwidth (10B, which the table here does not quote, lies between 1B and 100B on a
log scale), and every other column is then the model's prediction. Ratios to data parallel
do not depend on that calibration at all. Settings: every all-reduce hides behind half a
step (the backward pass), data parallel sends bf16 gradients, DiLoCo H=100, Streaming DiLoCo
H=100 with P=4 fragments, its overlap τ=1 inner step, outer gradients in bf16 or fp4.
"""

from __future__ import annotations

import argparse
import math
import sys

from diloco.outer.perf_model import SyncPlan, bandwidth_for
from experiments.common import add_output_arguments, markdown_table, write_result

BACKWARD = 0.5  # share of a step an all-reduce hides behind
METHODS = {
    "data parallel": SyncPlan(sync_every=1, bits_per_param=16, overlap_backward=BACKWARD),
    "DiLoCo H=100": SyncPlan(sync_every=100, bits_per_param=16, overlap_backward=BACKWARD),
    "Streaming P=4": SyncPlan(sync_every=100, fragments=4, bits_per_param=16, overlap_backward=BACKWARD),
    "+ overlap τ=1": SyncPlan(
        sync_every=100, fragments=4, overlap_steps=1, bits_per_param=16, overlap_backward=BACKWARD
    ),
    "+ overlap, fp4": SyncPlan(
        sync_every=100, fragments=4, overlap_steps=1, bits_per_param=4, overlap_backward=BACKWARD
    ),
}
# Gbit/s for 95% compute utilization, Streaming DiLoCo (arXiv 2501.18512) Table 4; None: not quoted.
PAPER = {
    1e9: [222.3, 23.3, 16.0, 9.1, 2.0],
    1e11: [390.7, 49.4, None, None, 1.1],
}
SIZES = (1e9, 1e10, 1e11)


def calibrated_step_s(params: float, target: float, groups: int) -> float:
    """The step time at which data parallel needs the paper's bandwidth (bandwidth_for ∝ 1/step)."""
    if params in PAPER:
        at_one_second = bandwidth_for(target, METHODS["data parallel"], params, 1.0, groups)
        return at_one_second / (PAPER[params][0] * 1e9)
    low, high = calibrated_step_s(SIZES[0], target, groups), calibrated_step_s(SIZES[-1], target, groups)
    share = (math.log(params) - math.log(SIZES[0])) / (math.log(SIZES[-1]) - math.log(SIZES[0]))
    return math.exp(math.log(low) + share * (math.log(high) - math.log(low)))


def rows(target: float, groups: int) -> list[list[str]]:
    out = []
    for params in SIZES:
        step_s = calibrated_step_s(params, target, groups)
        needed = [bandwidth_for(target, plan, params, step_s, groups) / 1e9 for plan in METHODS.values()]
        published = PAPER.get(params, [None] * len(METHODS))
        cells = [f"{ours:.1f} ({'–' if theirs is None else f'{theirs:g}'})" for ours, theirs in zip(needed, published)]
        out.append([f"{params / 1e9:g}B", f"{step_s:.2f}", *cells])
    return out


def ratio_rows(target: float, groups: int) -> list[list[str]]:
    """Each method's bandwidth as a share of data parallel's: the model's against the paper's."""
    base = bandwidth_for(target, METHODS["data parallel"], 1e9, 1.0, groups)
    ours = [bandwidth_for(target, plan, 1e9, 1.0, groups) / base for plan in METHODS.values()]
    out = [["model", *(f"{r:.3f}" for r in ours)]]
    for params, published in PAPER.items():
        shares = ["–" if v is None else f"{v / published[0]:.3f}" for v in published]
        out.append([f"paper {params / 1e9:g}B", *shares])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utilization", type=float, default=0.95, help="target compute utilization")
    parser.add_argument("--groups", type=int, default=2, help="replica groups (data centres) in the ring")
    add_output_arguments(parser)
    args = parser.parse_args()
    headers = ["size", "step s (calibrated)", *(f"{name} Gbit/s (paper)" for name in METHODS)]
    text = "\n".join(
        [
            f"Bandwidth for {100 * args.utilization:g}% compute utilization, {args.groups} groups; model (paper).",
            "",
            markdown_table(headers, rows(args.utilization, args.groups)),
            "",
            "Share of data parallel's bandwidth (independent of the step time):",
            "",
            markdown_table(["", *METHODS], ratio_rows(args.utilization, args.groups)),
        ]
    )
    print(text)
    print(f"table written to {write_result('simulate_scale.md', text, args.results)}", file=sys.stderr)


if __name__ == "__main__":
    main()
