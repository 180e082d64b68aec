"""algo.auto against Streaming DiLoCo's fixed defaults, over a slow link and a fast one.

Two replica groups of one CPU process train the tiny model with Streaming DiLoCo, H=100,
P=2 fragments, the preset's τ=1 and fp4 outer gradients (``conf/experiment/auto_tune.yaml``).
The link between groups is limited in the lane transport (``cluster.lane_bandwidth_mbps``, a
token bucket on each worker's outer traffic). For each bandwidth the job runs twice, the
same number of inner steps:

- fixed: the preset's τ and format, whatever the link;
- ``algo.auto=true``: after every round the groups re-pick τ and the format from what they
  measured (inner step time, the link's seconds per byte), so each fragment's all-reduce
  hides behind its overlap (``diloco/outer/overlap_plan.py``); the first round runs the preset's.

Reported from each run directory: training seconds, final eval loss of the global model, the
plan of the last round (from the commit logs), and the median time a round held training up.

    python experiments/auto_tune.py            # 4 runs, about 3 minutes in all
    python experiments/auto_tune.py --quick    # H=40 and 120 steps each: a smoke test

Prints a markdown table and writes it to experiments/results/auto_tune.md (numbers also to
auto_tune.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    add_output_arguments,
    compose_job,
    markdown_table,
    run_job,
    runs_root,
    stop_on_sigterm,
    write_result,
)
from fault_tolerance import digests_equal

from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl

EXPERIMENT = "auto_tune"
LINKS_MBPS = (1.0, 0.0)  # a slow link, and an unlimited one (0)
PLANS = {"fixed": ["algo.auto=false"], "auto": ["algo.auto=true"]}


def link_name(mbps: float) -> str:
    return f"{mbps:g} Mbit/s" if mbps else "unlimited"


def numbers(run_dir: Path) -> dict[str, Any]:
    paths = RunPaths(run_dir)
    summary = json.loads(paths.summary.read_text())
    committed = [r for r in read_jsonl(paths.commits(0)) if r["committed"]]
    last = committed[-1] if committed else {}
    return {
        "ok": summary["ok"],
        "train_s": summary["train_seconds"],  # the slowest group's
        "final_eval_loss": summary["final_eval_loss"],
        "rounds": len(committed),
        "round_ms": statistics.median(r["sync_ms"] for r in committed) if committed else float("nan"),
        "plan": f"τ={last['delay']}, {last['quantize']}" if "delay" in last else None,
        "digests_agree": digests_equal(summary)[0],
    }


def table(figures: dict[str, dict[str, dict[str, Any]]], preset: str) -> str:
    rows = []
    for link, runs in figures.items():
        fixed = runs["fixed"]
        for name, n in runs.items():
            rows.append(
                [
                    link,
                    name,
                    n["plan"] or preset,
                    f"{n['train_s']:.1f}",
                    f"{n['train_s'] / fixed['train_s']:.2f}x",
                    f"{n['round_ms']:.0f}",
                    f"{n['final_eval_loss']:.4f}",
                    f"{n['final_eval_loss'] / fixed['final_eval_loss'] - 1:+.2%}",
                ]
            )
    headers = [
        "link",
        "plan",
        "τ, format (last round)",
        "train s",
        "vs fixed",
        "round ms",
        "final eval loss",
        "vs fixed",
    ]
    return markdown_table(headers, rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H=40 and 120 inner steps per run: a smoke test")
    parser.add_argument("--steps", type=int, help="inner steps per run, a multiple of H (default 1000; --quick 120)")
    parser.add_argument(
        "--links", type=float, nargs="+", default=LINKS_MBPS, help="lane bandwidths in Mbit/s (0: unlimited)"
    )
    add_output_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    began = time.monotonic()
    steps = args.steps or (120 if args.quick else 1000)
    quick = ["algo.sync_every=40"] if args.quick else []  # H/P = 20: rounds often enough to re-plan
    job = compose_job([*quick, f"trainer.max_steps={steps}"], EXPERIMENT)
    preset = f"τ={job.algo.delay}, {job.algo.quantize}"
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    with runs_root(args.keep_runs, EXPERIMENT) as root:
        for mbps in args.links:
            link = link_name(mbps)
            figures[link] = {}
            for name, overrides in PLANS.items():
                started = time.monotonic()
                run_dir = root / f"{mbps:g}mbps-{name}"
                shared = [*quick, f"trainer.max_steps={steps}", f"cluster.lane_bandwidth_mbps={mbps}"]
                run_job(compose_job(shared + overrides, EXPERIMENT), run_dir)
                figures[link][name] = numbers(run_dir)
                print(f"{link}, {name}: done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    a = job.algo
    setup = (
        f"Streaming DiLoCo H={a.sync_every}, P={a.fragments}, α={a.alpha:g}, 2 groups x 1 CPU process, tiny model, "
        f"{steps} inner steps per run; fixed: the preset's {preset}; auto: re-planned after every round from the "
        "measured step time and link (the first round runs the preset's). Round ms: median time a round held "
        "training up (the all-reduce's wait included when it is not hidden)."
    )
    checks = [
        f"- {link}: auto {verdict_line(runs)}" for link, runs in figures.items() if "auto" in runs and "fixed" in runs
    ]
    text = "\n".join([setup, "", table(figures, preset), "", *checks])
    print(text)
    print(f"table written to {write_result('auto_tune.md', text, args.results)}", file=sys.stderr)
    write_result("auto_tune.json", json.dumps(figures, indent=2), args.results)
    print(f"total wall time {time.monotonic() - began:.0f}s", file=sys.stderr)


def verdict_line(runs: dict[str, dict[str, Any]]) -> str:
    """How the auto run compares with the fixed one: wall time and loss, and whether both runs are sound."""
    auto, fixed = runs["auto"], runs["fixed"]
    sound = all(n["ok"] and n["digests_agree"] for n in (auto, fixed))
    return (
        f"{auto['train_s'] / fixed['train_s']:.2f}x the fixed plan's training time, final eval loss "
        f"{auto['final_eval_loss'] / fixed['final_eval_loss'] - 1:+.2%}; runs ok with equal digests: {sound}"
    )


if __name__ == "__main__":
    main()
