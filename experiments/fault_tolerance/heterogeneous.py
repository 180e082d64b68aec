"""Groups of different speed: step-bounded against time-bounded windows, one group at half speed.

Two replica groups of one CPU process train the tiny model with DiLoCo, H=50
(``conf/experiment/heterogeneous.yaml``). Group 1 is a real straggler: after every inner step
it sleeps as long as the step took (``faults.slowdown=2``), so it computes at half speed and
lends its core to nobody. The job runs twice, one after the other:

- ``algo.window=steps``: every group runs H inner steps per window, so at each round the fast
  group waits for the slow one;
- ``algo.window=time``: a window lasts as long as the fast group takes for its H steps; the
  slow group learns that the round opened, skips to it after the steps it managed (about
  H/2), and its pseudo-gradient counts by the tokens it trained (``algo.weighting=tokens``).

Both runs train the same number of tokens: in the time-bounded run the slow group brings
about 1/slowdown of a group's tokens per window, so its ``trainer.max_steps`` is the other's
times M / (M − 1 + 1/slowdown), rounded to a multiple of H. Reported from each run directory
(summary.json and the commit logs): training seconds, tokens trained, job throughput (tokens
per second of training), final eval loss of the global model, the slow group's inner steps per
window and its share of the rounds.

    python -m experiments.fault_tolerance.heterogeneous            # 2 runs, about 1.5 minutes in all
    python -m experiments.fault_tolerance.heterogeneous --quick    # H=20, 200 steps of 4 x 64 tokens: a smoke test

Prints a markdown table and the target checks (throughput >= 1.3x, final eval loss within
1%) and writes them to experiments/results/heterogeneous.md; plots train loss against wall
time for both runs to experiments/results/heterogeneous.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.outer.perf_model import time_window_speedup
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from experiments.common import (
    NO_MATPLOTLIB,
    RESULTS,
    add_output_arguments,
    compose_job,
    markdown_table,
    pyplot,
    run_job,
    runs_root,
    save_figure,
    stop_on_sigterm,
    verdict,
    write_result,
)
from experiments.fault_tolerance.kill_every import digests_equal

EXPERIMENT = "heterogeneous"
STEPS, TIME = "fixed H (algo.window=steps)", "time-bounded (algo.window=time)"
MIN_THROUGHPUT_RATIO = 1.3
LOSS_TOLERANCE = 0.01  # the time-bounded run's final eval loss at most 1% above the fixed-H one's


@dataclass
class Run:
    """What one run directory says."""

    summary: dict[str, Any]
    commits: dict[int, list[dict[str, Any]]]
    metrics: list[dict[str, Any]]  # group 0's


def load_run(run_dir: Path) -> Run:
    paths = RunPaths(run_dir)
    summary = json.loads(paths.summary.read_text())
    commits = {g: read_jsonl(paths.commits(g)) for g in range(summary["groups"])}
    return Run(summary, commits, read_jsonl(paths.metrics(0)))


def time_bounded_steps(steps: int, groups: int, slowdown: float, h: int) -> int:
    """Inner steps at which the time-bounded run trains as many tokens as ``steps`` step-bounded ones."""
    return max(h, round(steps * groups / (groups - 1 + 1 / slowdown) / h) * h)


def numbers(run: Run, slow_group: int, tokens_per_step: int) -> dict[str, Any]:
    per_group = {g["group"]: g for g in run.summary["per_group"]}
    seconds, tokens = run.summary["train_seconds"], run.summary["tokens_seen"]  # the slowest group's, all groups'
    rounds = run.summary["rounds"]
    slow_commits = [r for r in run.commits[slow_group] if r["committed"]]
    slow_steps = per_group[slow_group]["tokens_seen"] / tokens_per_step
    return {
        "ok": run.summary["ok"],
        "train_s": seconds,
        "tokens": tokens,
        "throughput": tokens / seconds,
        "final_eval_loss": run.summary["final_eval_loss"],
        "rounds": rounds,
        "slow_rounds": len(slow_commits),
        "slow_steps_per_window": slow_steps / rounds if rounds else float("nan"),
        "digests_agree": digests_equal(run.summary)[0],
    }


def table(figures: dict[str, dict[str, Any]], h: int) -> str:
    base = figures[STEPS]
    rows = []
    for name, n in figures.items():
        rows.append(
            [
                name,
                f"{n['train_s']:.1f}",
                f"{n['tokens']:,}",
                f"{n['throughput']:,.0f}",
                f"{n['throughput'] / base['throughput']:.2f}x",
                f"{n['final_eval_loss']:.4f}",
                f"{n['final_eval_loss'] / base['final_eval_loss'] - 1:+.2%}",
                f"{n['slow_steps_per_window']:.1f} of {h}",
                f"{n['slow_rounds']} / {n['rounds']}",
            ]
        )
    headers = [
        "windows",
        "train s",
        "tokens",
        "tokens/s",
        "throughput",
        "final eval loss",
        "vs fixed H",
        "slow group's steps per window",
        "rounds with the slow group",
    ]
    return markdown_table(headers, rows)


def targets(figures: dict[str, dict[str, Any]]) -> list[str]:
    base, timed = figures[STEPS], figures[TIME]
    ratio = timed["throughput"] / base["throughput"]
    loss = timed["final_eval_loss"] / base["final_eval_loss"] - 1
    return [
        f"- throughput, time-bounded / fixed H >= {MIN_THROUGHPUT_RATIO}: {ratio:.2f}x "
        f"{verdict(ratio >= MIN_THROUGHPUT_RATIO)}",
        f"- final eval loss, time-bounded within {LOSS_TOLERANCE:.0%} of fixed H: {loss:+.2%} "
        f"{verdict(loss <= LOSS_TOLERANCE)}",
        f"- every run ok, groups' final digests equal: "
        f"{verdict(all(n['ok'] and n['digests_agree'] for n in figures.values()))}",
    ]


def plot(runs: dict[str, Run], path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        points = [(m["time"], m["train/loss"]) for m in run.metrics if "train/loss" in m]
        if points:
            start = points[0][0]
            ax.plot([t - start for t, _ in points], [loss for _, loss in points], label=name)
    ax.set_xlabel("wall seconds (group 0, the fast group)")
    ax.set_ylabel("train loss")
    ax.set_title("one group at half speed: fixed H against time-bounded windows")
    ax.legend()
    return save_figure(fig, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H=20, 200 inner steps of 4 x 64 tokens: a smoke test")
    parser.add_argument("--steps", type=int, help="inner steps of the fixed-H run (default 1000; --quick: 200)")
    parser.add_argument("--slowdown", type=float, default=2.0, help="how many times slower group 1 is (default 2)")
    add_output_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    began = time.monotonic()
    shared = ["algo.sync_every=20", "trainer.batch_size=4", "trainer.seq_len=64"] if args.quick else []
    shared += [f"faults.slowdown={args.slowdown}"]
    job = compose_job(shared, EXPERIMENT)
    h, groups = job.algo.sync_every, job.cluster.groups
    steps = args.steps or (200 if args.quick else 1000)
    t = job.trainer
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum * job.cluster.workers_per_group
    plans = {
        STEPS: ["algo.window=steps", f"trainer.max_steps={steps}"],
        TIME: ["algo.window=time", f"trainer.max_steps={time_bounded_steps(steps, groups, args.slowdown, h)}"],
    }
    runs = {}
    with runs_root(args.keep_runs, EXPERIMENT) as root:
        for name, overrides in plans.items():
            started = time.monotonic()
            run_dir = root / name.split()[0].replace("-", "_")
            run_job(compose_job(shared + overrides, EXPERIMENT), run_dir)
            runs[name] = load_run(run_dir)
            print(f"{name} done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    figures = {name: numbers(run, job.faults.slow_group, tokens_per_step) for name, run in runs.items()}
    setup = (
        f"DiLoCo H={h}, {groups} groups x 1 CPU process, {runs[STEPS].summary['parameters'] / 1e6:.2f}M parameters; "
        f"group {job.faults.slow_group} sleeps after each inner step so that it takes {args.slowdown:g}x as long. "
        f"Equal tokens: the fixed-H run trains {steps} inner steps, the time-bounded one "
        f"{time_bounded_steps(steps, groups, args.slowdown, h)} (its slow group runs fewer per window). "
        "Throughput: tokens trained per second of training, all groups; the performance model predicts "
        f"{time_window_speedup([1.0] * (groups - 1) + [args.slowdown]):.2f}x "
        "(diloco.outer.perf_model.time_window_speedup)."
    )
    folder = Path(args.results) if args.results else RESULTS
    drawn = plot(runs, folder / "heterogeneous.png")
    text = "\n".join([setup, "", table(figures, h), "", *targets(figures), "", drawn])
    print(text)
    print(f"table written to {write_result('heterogeneous.md', text, args.results)}", file=sys.stderr)
    write_result("heterogeneous.json", json.dumps(figures, indent=2), args.results)
    print(f"total wall time {time.monotonic() - began:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
