"""Does training apart cost less as the model grows? DiLoCo H=50 against data parallel by model size.

``python -m experiments.outer_recipe.gap_vs_size --models mini midi small --steps 1000 [--first-seed S] [--keep-runs DIR]``
``python -m experiments.outer_recipe.gap_vs_size --collect DIR [DIR ...]``: the same from runs kept (``--keep-runs``)
here or by ``experiments/outer_recipe/compare_ddp.py`` (its ``ddp``, ``local`` and ``diloco H=50`` rows at M=2).

For each ``conf/model`` preset it runs ``experiments/outer_recipe/compare_ddp.py``'s ``ddp``, ``local`` and
``diloco H=50`` rows at M = 2 groups, one after the other, the same preset and batches, and gives
per model and length: the parameters, the three final eval losses, DiLoCo's ratio to data
parallel and the gap closed, (local − x)/(local − ddp). The DiLoCo scaling laws (arXiv
2503.09799) find the cost of M > 1 shrinking as models grow; the PNG draws the gap closed
against parameters (log scale), one line per length.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time
from pathlib import Path

from experiments.common import (
    NO_MATPLOTLIB,
    RESULTS,
    add_output_arguments,
    markdown_table,
    pyplot,
    runs_root,
    save_figure,
    write_result,
)
from experiments.outer_recipe.compare_ddp import (
    EVAL_EVERY,
    EXPERIMENT,
    Planned,
    RunResult,
    baseline,
    gap_closed,
    kept_by_shape,
    plan,
    run_grid,
    shared_overrides,
    vs_ddp,
)
from experiments.outer_recipe.compare_ddp import parse_args as compare_args

ROWS = ("ddp", "local", "diloco H=50")
GROUPS = 2


def planned(models: list[str], steps: int, seed: int, device: str, root: Path) -> list[Planned]:
    """The three rows at every model, each model's runs under ``root / model``."""
    out = []
    for model in models:
        args = compare_args(
            ["--model", model, "--steps", str(steps), "--first-seed", str(seed), "--groups", str(GROUPS)]
            + ["--device", device, "--only", *ROWS]
        )
        (root / model).mkdir(parents=True, exist_ok=True)
        out += plan(args, root / model, shared_overrides(model, steps, device), model, steps)
    return out


def scan(jobs: list[Planned]) -> dict[tuple[str, int], list[RunResult]]:
    """Run ``jobs`` one at a time: their results by (model, steps)."""
    found: dict[tuple[str, int], list[RunResult]] = {}
    for job, result in zip(jobs, run_grid(jobs, 1)):
        found.setdefault((job.marker["model"], job.marker["steps"]), []).append(result)
    return found


def point(runs: list[RunResult], seed: int) -> dict[str, float | None] | None:
    """One model at one length and seed: its parameters, the three losses, vs ddp and gap closed
    (None where the DiLoCo run is missing)."""
    diloco = [r for r in runs if r.config.name == "diloco H=50" and r.config.groups == GROUPS and r.seed == seed]
    if not diloco:
        return None
    run = diloco[0]
    return {
        "parameters": run.summary["parameters"],
        "ddp": baseline(runs, "ddp", GROUPS, seed),
        "local": baseline(runs, "local", GROUPS, seed),
        "diloco": run.loss if math.isfinite(run.loss) else None,
        "vs_ddp": vs_ddp(runs, run),
        "gap_closed": gap_closed(runs, run),
    }


def points(found: dict[tuple[str, int], list[RunResult]]) -> list[dict]:
    """Every (model, length, seed) with a DiLoCo run, smallest model first, then by length and seed."""
    out = []
    for (model, steps), runs in found.items():
        for seed in sorted({r.seed for r in runs}):
            if (p := point(runs, seed)) is not None:
                out.append({"model": model, "steps": steps, "seed": seed} | p)
    return sorted(out, key=lambda p: (p["parameters"], p["steps"], p["seed"]))


def _cell(value: float | None, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    return "–" if value is None else format(scale * value, fmt) + unit


def table(scanned: list[dict]) -> str:
    headers = ["model", "parameters", "inner steps", "seed", "ddp", "local", "diloco H=50", "vs ddp", "gap closed"]
    body = [
        [
            p["model"],
            f"{p['parameters'] / 1e6:.2f}M",
            str(p["steps"]),
            str(p["seed"]),
            _cell(p["ddp"], ".4f"),
            _cell(p["local"], ".4f"),
            _cell(p["diloco"], ".4f"),
            _cell(p["vs_ddp"], "+.1f", 100, "%"),
            _cell(p["gap_closed"], ".0f", 100, "%"),
        ]
        for p in scanned
    ]
    return markdown_table(headers, body)


def plot(scanned: list[dict], path: Path, title: str) -> str:
    """The gap closed against parameters (log scale), one line per length (mean over seeds)."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for steps in sorted({p["steps"] for p in scanned}):
        at: dict[tuple[int, str], list[float]] = {}
        for p in scanned:
            if p["steps"] == steps and p["gap_closed"] is not None:
                at.setdefault((p["parameters"], p["model"]), []).append(100 * p["gap_closed"])
        sizes = sorted(at)
        closed = [sum(at[n]) / len(at[n]) for n in sizes]
        ax.plot([n for n, _ in sizes], closed, marker="o", label=f"{steps} inner steps")
        for (n, model), value in zip(sizes, closed):
            ax.annotate(model, (n, value), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(100, ls="--", color="black", lw=1, label="data parallel")
    ax.axhline(0, ls="--", color="grey", lw=1, label="no communication (local)")
    ax.set_xscale("log")
    ax.set_xlabel("parameters (log)")
    ax.set_ylabel("gap closed by DiLoCo H=50, M=2 (%)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(textwrap.fill(title, 70), fontsize=9, loc="left")
    return save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mini", "midi"], help="conf/model presets, in any order")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps of every job, a multiple of 100")
    parser.add_argument("--first-seed", type=int, default=1, help="trainer.seed of every job")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cluster.device of every job")
    parser.add_argument(
        "--collect", nargs="+", metavar="DIR", type=Path, help="run nothing: the scan from runs kept under DIR"
    )
    add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.monotonic()
    if args.collect:
        kept = kept_by_shape(args.collect)
        if len({device for *_, device in kept}) > 1:  # a GPU job's corpus and precision are not this machine's
            sys.exit(f"--collect: runs of one device only, found {sorted(kept)} under {args.collect}")
        found = {(model, steps): runs for (model, steps, _), runs in kept.items()}
    else:
        if args.steps < EVAL_EVERY or args.steps % EVAL_EVERY:
            sys.exit(f"--steps={args.steps}: must be a positive multiple of {EVAL_EVERY}, as compare_ddp's")
        with runs_root(args.keep_runs, EXPERIMENT) as root:
            found = scan(planned(args.models, args.steps, args.first_seed, args.device, root))
    scanned = points(found)
    if not scanned:
        sys.exit(f"no finished diloco H=50 run at M={GROUPS}" + (f" under {args.collect}" if args.collect else ""))
    title = f"DiLoCo H=50 against data parallel and local, M={GROUPS}, conf/experiment/{EXPERIMENT}.yaml's batches"
    folder = Path(args.results) if args.results else RESULTS
    text = "\n".join([title, "", table(scanned), "", plot(scanned, folder / "gap_vs_size.png", title)])
    print(text)
    print(f"table written to {write_result('gap_vs_size.md', text, args.results)}", file=sys.stderr)
    write_result("gap_vs_size.json", json.dumps(scanned, indent=2), args.results)
    print(f"total wall time {(time.monotonic() - began) / 60:.1f} min", file=sys.stderr)
    failed = [f"{p['model']} {p['steps']} steps seed {p['seed']}" for p in scanned if p["gap_closed"] is None]
    if failed:
        sys.exit(f"no gap closed (a run failed or a baseline is missing) for: {', '.join(failed)}")


if __name__ == "__main__":
    main()
