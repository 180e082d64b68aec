"""What one DiLoCo outer sync costs against an inner step, and how fast a killed group is back.

For M = 2, 3, 4 replica groups (one CPU process each) training a ~2M-parameter model with
DiLoCo at H=10 (``conf/experiment/bench_sync.yaml``), one job per M:

1. train until every group logged ``--steps`` inner steps after a first window left out
   for start-up (at least 8 syncs); from the per-step metrics take the median
   ``outer/sync_ms`` (quorum + all-reduce of Δ + outer step, measured by the library on
   the step a sync is applied) and the median ``train/step_ms`` of the steps without a sync;
2. SIGKILL the last group, wait until the survivors commit a round without it, restart it
   (``LocalCluster.start_group``) and time from that call to the first committed record in
   its commit log whose participants are all M groups (start-up, rendezvous, quorum,
   healing from a live peer in its join round, which commits nothing, then the peers' next
   round).

    python -m experiments.parallelism.bench_sync            # M = 2, 3, 4; a few minutes on two cores
    python -m experiments.parallelism.bench_sync --quick    # M = 2, fewer and smaller steps: a smoke test

Prints a markdown table and the target check, and writes the table to
experiments/results/bench_sync.md. Timings on a shared 2-core machine are noisy: read the
ratio, not the milliseconds.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.common import (
    ClusterRun,
    add_output_arguments,
    compose_job,
    markdown_table,
    median,
    runs_root,
    verdict,
    write_result,
)

HEADERS = [
    "groups",
    "median outer sync ms",
    "median inner step ms",
    "sync / inner-step ratio",
    "restart-to-first-commit s",
]
TARGET_RATIO = 2.0
SKIP_STEPS = 10  # the first window: start-up of the other groups competes for the cores
ENDLESS = 100_000  # max_steps of the job: it is stopped once measured, so the schedule never ends it
# --quick: a smoke run of 4 x 64 tokens a step (the syncs' 2M parameters stay; their ratio to the step does not)
QUICK_SHAPE = ["trainer.batch_size=4", "trainer.seq_len=64"]


@dataclass
class Row:
    groups: int
    n_params: int
    syncs: int
    sync_ms: float
    step_ms: float
    restart_s: float

    @property
    def ratio(self) -> float:
        return self.sync_ms / self.step_ms

    def cells(self) -> list[str]:
        return [
            str(self.groups),
            f"{self.sync_ms:.1f}",
            f"{self.step_ms:.1f}",
            f"{self.ratio:.2f}",
            f"{self.restart_s:.1f}",
        ]


def step_timings(run: ClusterRun, groups: int, steps: int) -> tuple[list[float], list[float]]:
    """(outer sync ms of every applied sync, inner step ms of every step without one), all groups.

    Steps up to SKIP_STEPS are left out; a group that healed at its start has no records there.
    """
    syncs, inner = [], []
    for g in range(groups):
        for record in run.metrics(g):
            if not SKIP_STEPS < record["step"] <= SKIP_STEPS + steps:
                continue
            if "outer/sync_ms" in record:
                syncs.append(record["outer/sync_ms"])
            elif "train/step_ms" in record:  # a sync step's step_ms includes the sync: leave it out
                inner.append(record["train/step_ms"])
    return syncs, inner


def last_step(run: ClusterRun, group: int) -> int:
    records = run.metrics(group)
    return records[-1]["step"] if records else 0


def time_restart(run: ClusterRun, groups: int, timeout_s: float) -> float:
    """Kill the last group, let the others go on without it, restart it; seconds to its first full commit."""
    victim = groups - 1
    survivor_lines = len(run.commits(0))
    run.cluster.signal_group(victim, signal.SIGKILL)
    if groups > 1:
        run.cluster.wait_for(
            lambda: run.committed_by(0, groups - 1, survivor_lines),
            timeout_s,
            f"the survivors to commit without group {victim}",
            poll_s=0.2,
        )
    before = len(run.commits(victim))
    started = time.monotonic()
    run.cluster.start_group(victim)
    run.cluster.wait_for(
        lambda: run.committed_by(victim, groups, before), timeout_s, f"restarted group {victim} to commit", poll_s=0.05
    )
    return time.monotonic() - started


def measure(groups: int, steps: int, run_dir: Path, timeout_s: float, shape: list[str]) -> Row:
    overrides = ["algo=diloco", f"cluster.groups={groups}", f"trainer.max_steps={ENDLESS}", *shape]
    job = compose_job(overrides, "bench_sync")
    with ClusterRun(job, run_dir) as run:
        run.cluster.wait_for(
            lambda: all(last_step(run, g) >= SKIP_STEPS + steps for g in range(groups)),
            timeout_s,
            f"every group to reach step {SKIP_STEPS + steps}",
            poll_s=0.5,  # reading the growing logs costs CPU the workers need
        )
        syncs, inner = step_timings(run, groups, steps)
        restart_s = time_restart(run, groups, timeout_s)
    return Row(groups, run.n_params, len(syncs), median(syncs), median(inner), restart_s)


def report(rows: list[Row], h: int, steps: int) -> str:
    n_params = rows[0].n_params
    syncs = ", ".join(f"{r.groups} groups {r.syncs}" for r in rows)
    lines = [
        f"DiLoCo outer sync vs inner step: {n_params / 1e6:.2f}M fp32 parameters, H={h}, one CPU process per "
        f"group, {steps} timed steps per group after {SKIP_STEPS} start-up steps; medians over all groups' "
        f"steps (syncs timed: {syncs})",
        "",
        markdown_table(HEADERS, [r.cells() for r in rows]),
        "",
    ]
    two = next((r for r in rows if r.groups == 2), None)
    if two is not None:
        lines.append(
            f"2-group sync of ~{n_params / 1e6:.0f}M fp32 params costs <= {TARGET_RATIO:.0f} inner steps: "
            f"{verdict(two.ratio <= TARGET_RATIO)} (ratio {two.ratio:.2f})"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 groups, 40 steps of 4 x 64 tokens: a smoke test")
    parser.add_argument("--groups", type=int, nargs="+", help="group counts (default 2 3 4; --quick: 2)")
    parser.add_argument("--steps", type=int, help="timed inner steps per group (default 100; --quick: 40)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    add_output_arguments(parser)
    args = parser.parse_args()
    groups = args.groups or ([2] if args.quick else [2, 3, 4])
    steps = args.steps or (40 if args.quick else 100)

    h = compose_job([], "bench_sync").algo.sync_every
    rows = []
    with runs_root(args.keep_runs, "bench_sync") as root:
        for m in groups:
            started = time.monotonic()
            rows.append(measure(m, steps, root / f"groups{m}", args.timeout, QUICK_SHAPE if args.quick else []))
            print(f"{m} groups measured in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    text = report(rows, h, steps)
    print(text)
    print(f"table written to {write_result('bench_sync.md', text, args.results)}", file=sys.stderr)


if __name__ == "__main__":
    main()
