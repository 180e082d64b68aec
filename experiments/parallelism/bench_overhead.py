"""What outer syncs cost in wall time and in bytes: DiLoCo and Streaming DiLoCo against no sync and DDP.

Two groups of one CPU process each train the same 0.8M-parameter, 4-block model for the same
steps (``conf/experiment/bench_overhead.yaml``) three ways, run one after another and
repeated with the order rotated (the machine has two cores; medians over the repeats):

- ``algo=local``: no outer sync at all, the baseline;
- DiLoCo, H=50: the whole model's pseudo-gradient, fp32, all-reduced every 50 steps;
- Streaming DiLoCo, H=100, P=4 fragments, overlap tau=1, 4-bit (fp4) payloads.

The time of a run is its inner loop: per group the sum of the per-step ``train/step_ms``
(every step, outer work included), the slowest group's sum. That leaves out process
start-up, the first quorum's wait for the other group to start, and the final evaluation,
which are not the cost of syncing; the groups' ``train_seconds`` (which include them) are
shown beside it. The overhead is taken per repeat against the local run of that repeat, then
the median; "outer-step excess" is a view of the same cost that background load on a shared
machine disturbs less (see ``outer_excess_pct``). Bytes per token (summary.json) are compared with ``algo=ddp``, which
all-reduces gradients every step; a short DDP run suffices as its bytes per token are the
same every step.

    python -m experiments.parallelism.bench_overhead           # 5 repeats, 200 steps: about 6 minutes on two cores
    python -m experiments.parallelism.bench_overhead --quick   # 1 repeat, 100 steps, a smaller model and batch

Prints two markdown tables and the target checks, and writes them to
experiments/results/bench_overhead.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from experiments.common import (
    add_output_arguments,
    compose_job,
    markdown_table,
    median,
    run_job,
    runs_root,
    verdict,
    write_result,
)

NO_WARMUP = "algo.sync_warmup_steps=0"  # every window H long: the overhead of H's rounds, not the warm-up's
LOCAL = "local (no sync)"
DILOCO = "diloco H=50"
STREAMING = "streaming H=100 P=4 tau=1 fp4"
CONFIGS = {
    LOCAL: ["algo=local"],
    DILOCO: ["algo=diloco", "algo.sync_every=50", NO_WARMUP],
    STREAMING: [
        "algo=streaming",
        "algo.sync_every=100",
        "algo.fragments=4",
        "algo.delay=1",
        "algo.quantize=fp4",
        NO_WARMUP,
    ],
}
DDP = ["algo=ddp"]
TIME_HEADERS = [
    "config",
    "syncs committed (all groups)",
    "with syncs s",
    "algo=local s",
    "overhead % (per repeat)",
    "outer-step excess %",
    "train_seconds sync / local",
]
BYTES_HEADERS = ["config", "bytes sent", "bytes / token", "ddp bytes/token / config bytes/token"]
MAX_OVERHEAD_PCT = 3.0
MIN_BYTES_RATIO = 400.0


@dataclass
class Run:
    loop_s: float
    train_s: float
    syncs: int
    bytes_sent: int
    bytes_per_token: float
    parameters: int
    excess_pct: float


def outer_excess_pct(records: list[dict], delay: int) -> float:
    """A noise-robust view of the same cost: the extra time of the steps that do outer work.

    The steps from a fragment's launch (s - tau) to its apply (s) are compared with the run's
    median step; their excess over it, summed, is given as a percentage of steps x median.
    Background load slows every step alike and cancels out; slowness spread over all steps
    by the syncs would not be seen, which the wall-time column does see.
    """
    times = {r["step"]: r["train/step_ms"] for r in records if r.get("train/step_ms") is not None}
    if not times:
        return 0.0
    typical = median(list(times.values()))
    outer = {r["step"] - d for r in records if "outer/sync_ms" in r for d in range(delay + 1)}
    return 100.0 * sum(times[s] - typical for s in outer if s in times) / (len(times) * typical)


def run_config(overrides: list[str], run_dir: Path) -> Run:
    job = compose_job(overrides, "bench_overhead")
    summary = run_job(job, run_dir)
    loops, excess = [], []
    for g in range(job.cluster.groups):
        records = read_jsonl(RunPaths(run_dir).metrics(g))
        loops.append(sum(r["train/step_ms"] for r in records if r.get("train/step_ms") is not None) / 1e3)
        excess.append(outer_excess_pct(records, job.algo.delay))
    return Run(
        loop_s=max(loops),
        train_s=summary["train_seconds"],
        syncs=summary["syncs_committed"],
        bytes_sent=summary["bytes_sent"],
        bytes_per_token=summary["bytes_per_token"],
        parameters=summary["parameters"],
        excess_pct=max(excess),
    )


def time_table(runs: dict[str, list[Run]]) -> tuple[str, dict[str, float]]:
    """Overhead per repeat against the local run of the same repeat (neighbours in time), then the median."""
    local = runs[LOCAL]
    rows, overheads = [], {}
    for name in (DILOCO, STREAMING):
        per_repeat = [100.0 * (run.loop_s / base.loop_s - 1.0) for run, base in zip(runs[name], local)]
        overheads[name] = median(per_repeat)
        rows.append(
            [
                name,
                str(runs[name][0].syncs),
                f"{median([r.loop_s for r in runs[name]]):.2f}",
                f"{median([r.loop_s for r in local]):.2f}",
                f"{overheads[name]:+.1f} ({', '.join(f'{p:+.1f}' for p in per_repeat)})",
                f"{median([r.excess_pct for r in runs[name]]):+.1f}",
                f"{median([r.train_s for r in runs[name]]):.2f} / {median([r.train_s for r in local]):.2f}",
            ]
        )
    return markdown_table(TIME_HEADERS, rows), overheads


def bytes_table(runs: dict[str, list[Run]], ddp: Run) -> tuple[str, dict[str, float]]:
    """Bytes per token against DDP's (a ratio of 0 means the config sent nothing: a failure of the check)."""
    rows = [["ddp (every step)", f"{ddp.bytes_sent:,}", f"{ddp.bytes_per_token:,.1f}", "1"]]
    ratios = {}
    for name in (DILOCO, STREAMING):
        run = runs[name][0]  # bytes are deterministic: any repeat will do
        ratios[name] = ddp.bytes_per_token / run.bytes_per_token if run.bytes_per_token > 0 else 0.0
        rows.append([name, f"{run.bytes_sent:,}", f"{run.bytes_per_token:,.2f}", f"{ratios[name]:,.0f}x"])
    return markdown_table(BYTES_HEADERS, rows), ratios


def report(setup: str, runs: dict[str, list[Run]], ddp: Run) -> str:
    times, overheads = time_table(runs)
    sizes, ratios = bytes_table(runs, ddp)
    overhead = overheads[STREAMING]
    excess = median([r.excess_pct for r in runs[STREAMING]])
    lines = [setup, "", times, "", sizes, ""]
    lines.append(
        f"streaming with overlap adds at most {MAX_OVERHEAD_PCT:.0f}% wall time: "
        f"{verdict(overhead <= MAX_OVERHEAD_PCT)} (overhead {overhead:+.1f}%; outer-step excess {excess:+.1f}%)"
    )
    ratio = ratios[STREAMING]
    lines.append(
        f"streaming fp4 at H=100 sends >= {MIN_BYTES_RATIO:.0f}x fewer bytes per token than ddp: "
        f"{verdict(ratio >= MIN_BYTES_RATIO)} (ratio {ratio:.1f})"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat of 100 steps with a smaller model and batch")
    parser.add_argument("--repeats", type=int, help="timing repeats (default 5; --quick: 1)")
    parser.add_argument("--steps", type=int, help="inner steps, a multiple of 100 (default 200; --quick: 100)")
    parser.add_argument("--ddp-steps", type=int, help="steps of the DDP run (default 20; --quick: 10)")
    add_output_arguments(parser)
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)
    steps = args.steps or (100 if args.quick else 200)
    ddp_steps = args.ddp_steps or (10 if args.quick else 20)
    # --quick: a smoke run; 4 x 64 tokens a step keep 100 steps to seconds (bytes per token, the
    # one deterministic check, does not depend on the batch: DDP and the syncs both scale with it).
    shared = ["model.dim=64", "trainer.batch_size=4", "trainer.seq_len=64"] if args.quick else []

    runs: dict[str, list[Run]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    with runs_root(args.keep_runs, "bench_overhead") as root:
        for rep in range(repeats):
            for i in range(len(names)):  # rotate the order so no config always runs first
                name = names[(rep + i) % len(names)]
                started = time.monotonic()
                run_dir = root / f"{name.split()[0]}-{rep}"
                runs[name].append(run_config(CONFIGS[name] + shared + [f"trainer.max_steps={steps}"], run_dir))
                print(f"repeat {rep}: {name} in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
        # No try: a failed DDP run ends the script with its error (the bytes check needs it).
        ddp = run_config(DDP + shared + [f"trainer.max_steps={ddp_steps}"], root / "ddp")

    model = compose_job(shared, "bench_overhead").model
    setup = (
        f"2 groups x 1 CPU process, {runs[LOCAL][0].parameters / 1e6:.2f}M parameters (dim {model.dim}, "
        f"{model.n_layers} blocks), {steps} steps (ddp: {ddp_steps}), {repeats} interleaved repeat(s); "
        "time = slowest group's summed per-step time (median over repeats); overhead % = with syncs / local - 1"
    )
    text = report(setup, runs, ddp)
    print(text)
    print(f"tables written to {write_result('bench_overhead.md', text, args.results)}", file=sys.stderr)


if __name__ == "__main__":
    main()
