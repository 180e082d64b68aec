"""Intra-group layouts on this machine's CPU: tokens/s and peak memory per worker of FSDP, FSDP x TP,
TP and pipeline stages, each with and without activation checkpointing and torch.compile, and the
pipeline's measured bubble against its schedule's theory.

Layouts (``conf/experiment/bench_parallel.yaml``'s 3.4M-parameter model, which tp=4 divides):
one group of 4 workers with ``algo=local`` (FSDP 4, FSDP 2 x TP 2, TP 4, PP 2 x FSDP 2, PP 4
with 1F1B and one microbatch per stage), and 2 groups of 2 workers with DiLoCo, one sync at the
last step (FSDP 2, TP 2). Each runs with
``trainer.activation_checkpoint`` none and full and ``trainer.compile`` false and true (a
combination the config refuses, such as compile with tp > 1 today, is a row with its one-line
refusal); ratios are against the FSDP layout with the same groups, workers and options.
``trainer.batch_size`` is sequences per data-parallel rank (the tp workers of one rank read the
same batch), so a group step holds batch x dp sequences: TP 4 trains on a quarter of FSDP 4's
tokens per step, and so do PP 2 x FSDP 2 and PP 4 (the pipeline's stages read one batch).

A second table runs the ``small`` preset (19.1M parameters; its 6 heads and 2 KV heads refuse
tp=4) at seq 512 as FSDP 4 with activation checkpointing none, full and selective, at a batch
where activations outweigh the model's sharded state: what checkpointing saves is the drop in
peak memory against ``none``.

A third table measures the pipeline bubble: one worker's step time T1 on a batch (two groups of
one worker, so each has one core, one thread) against two stages' Tp on the same batch with m
microbatches, GPipe and 1F1B (one core each); measured bubble = 1 − T1 / (2 x Tp), the share of
the two workers' time not spent on the one worker's work (idle, the stage-to-stage sends, and
the smaller matmuls of microbatches), against the schedule's (p − 1)/(m + p − 1).

Measured:
- tokens/s: per group the median of its per-step ``train/tokens_per_s`` records after the first
  ``WARMUP`` steps (compilation, first allocations) and leaving out steps with an outer sync,
  summed over the groups. Inner-step throughput, not the cost of syncing (bench_overhead).
- peak memory per worker: ``VmHWM`` (peak resident set) of each worker process from
  /proc/PID/status, polled while the job runs; the table gives the largest over the job's
  workers. It counts every page the process had resident at its peak: torch's libraries, the
  corpus and what the fork server shared copy-on-write, the model and optimizer shards, the
  outer state, activations, and what the allocator kept. Compare rows, not absolute values.

The machine's cores are shared by every worker (a one-group job runs 4 processes of one thread
each on two cores), and the tp all-reduces go over Gloo through loopback, not NVLink: on a GPU
node TP costs far less against FSDP than here.

    python -m experiments.parallelism.bench_parallel            # every row: about 15 minutes on two cores
    python -m experiments.parallelism.bench_parallel --quick    # FSDP 4 and FSDP 2 x TP 2, eager, small batch: ~40 s
    python -m experiments.parallelism.bench_parallel --pipeline # FSDP 4, PP 2 x FSDP 2 and PP 4, and the bubble table

Prints the tables and writes them to experiments/results/bench_parallel.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.config.base import ConfigError
from diloco.config.job import JobConfig
from diloco.launch.local_cluster import JobFailed
from experiments.common import (
    ClusterRun,
    add_output_arguments,
    add_steps_argument,
    compose_job,
    markdown_table,
    median,
    runs_root,
    stop_on_sigterm,
    write_result,
)

WARMUP = 2  # steps left out of tokens/s: the first compiles (trainer.compile) and allocates
TIMEOUT_S = 900.0
REFUSABLE = ("parallel.tp=", "parallel.pp=", "trainer.compile=", "trainer.activation_checkpoint=")  # what a row varies


@dataclass(frozen=True)
class Layout:
    """``groups`` replica groups of ``workers`` workers each, split dp x tp inside a group."""

    name: str
    groups: int
    workers: int
    tp: int
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None  # None: one per stage

    def overrides(self, steps: int) -> list[str]:
        """One group trains alone (``algo=local``); groups of DiLoCo sync once, at the last step."""
        algo = ["algo=local"]
        if self.groups > 1:
            algo = [
                "algo=diloco",
                f"algo.sync_every={steps}",
                "algo.sync_warmup_steps=0",
                f"cluster.min_groups={self.groups}",
            ]
        return algo + [
            f"trainer.max_steps={steps}",
            f"cluster.groups={self.groups}",
            f"cluster.workers_per_group={self.workers}",
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.pp_schedule={self.schedule}",
            f"trainer.microbatches={'null' if self.microbatches is None else self.microbatches}",
        ]


@dataclass(frozen=True)
class Options:
    checkpoint: str  # trainer.activation_checkpoint
    compile: bool

    def overrides(self) -> list[str]:
        return [f"trainer.activation_checkpoint={self.checkpoint}", f"trainer.compile={str(self.compile).lower()}"]

    @property
    def label(self) -> str:
        return f"AC {self.checkpoint}, {'compiled' if self.compile else 'eager'}"


@dataclass(frozen=True)
class Measured:
    """One job's numbers, or ``note``: why there are none (the config's refusal, the worker's error)."""

    tokens_per_s: float = float("nan")
    peak_mib: float = float("nan")
    step_ms: float = float("nan")
    tokens_per_step: int = 0
    note: str = ""


LAYOUTS = [
    Layout("FSDP 4", 1, 4, 1),
    Layout("FSDP 2 x TP 2", 1, 4, 2),
    Layout("TP 4", 1, 4, 4),
    Layout("PP 2 x FSDP 2", 1, 4, 1, pp=2),
    Layout("PP 4", 1, 4, 1, pp=4),
    Layout("2 groups x FSDP 2, DiLoCo", 2, 2, 1),
    Layout("2 groups x TP 2, DiLoCo", 2, 2, 2),
]
EAGER = [Options("none", False), Options("full", False)]
OPTIONS = EAGER + [Options("none", True), Options("full", True)]


QUICK_ROWS = [(LAYOUTS[0], EAGER[0]), (LAYOUTS[1], EAGER[0])]
QUICK_SHAPE = ["trainer.batch_size=1", "trainer.seq_len=128"]  # a smoke run: start-up dominates anyway

# The memory table: `small` at seq 512. Two sequences of 512 per worker hold a few hundred MiB
# of activations (12 blocks), several times the per-worker model state (19.1M x 16 bytes / 4 = 73 MiB).
SMALL = ["model=small", "trainer.seq_len=512", "trainer.batch_size=2", "trainer.log_every=1"]
SMALL_LAYOUT = LAYOUTS[0]
SMALL_CHECKPOINTS = ["none", "full", "selective"]
SMALL_STEPS = WARMUP + 2  # the peak comes in the first step; 2 steps time the recompute

# The bubble table: one worker against two stages on the same batch of 8 sequences.
BUBBLE_SHAPE = ["trainer.batch_size=8", "trainer.activation_checkpoint=none", "trainer.compile=false"]
BUBBLE_ONE = Layout("1 worker", 2, 1, 1)  # two groups of one: each worker has one core, as each stage has
BUBBLE_PIPELINES = [Layout(f"PP 2, {s}, m={m}", 1, 2, 1, 2, s, m) for s in ("gpipe", "1f1b") for m in (2, 4, 8)]
BUBBLE_HEADERS = ["layout", "step ms", "1 worker step ms", "measured bubble", "theory (p - 1)/(m + p - 1)"]

LAYOUT_HEADERS = [
    "layout",
    "options",
    "tokens / step",
    "tokens/s",
    "step ms",
    "peak RSS / worker MiB",
    "tokens/s vs FSDP",
    "peak vs FSDP",
]
MEMORY_HEADERS = [
    "activation checkpointing",
    "tokens/s",
    "peak RSS / worker MiB",
    "peak vs none MiB",
    "tokens/s vs none",
]


def vm_hwm_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM), MiB; 0 once it has exited (its /proc entry is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0.0


def measure(job: JobConfig, run_dir: Path) -> Measured:
    """Run ``job`` to its end, polling each worker's VmHWM; its steady tokens/s and the largest peak."""
    peaks: dict[tuple[int, int], float] = {}
    with ClusterRun(job, run_dir) as run:

        def poll() -> bool:
            for group, workers in run.cluster.groups.items():
                for w in workers:
                    key = (group, w.rank)
                    peaks[key] = max(peaks.get(key, 0.0), vm_hwm_mib(w.process.pid))
            return run.cluster.finished()

        run.cluster.wait_for(poll, TIMEOUT_S, "the benchmark job to finish", poll_s=0.2)
        records = [run.metrics(g) for g in range(job.cluster.groups)]
    rates = [steady(group, "train/tokens_per_s") for group in records]
    step_ms = [steady(group, "train/step_ms") for group in records]
    tokens_per_step = job.trainer.batch_size * job.parallel.dp(job.cluster.workers_per_group) * job.trainer.seq_len
    return Measured(
        tokens_per_s=sum(median(r) for r in rates),
        peak_mib=max(peaks.values()),
        step_ms=max(median(s) for s in step_ms),
        tokens_per_step=tokens_per_step * job.cluster.groups,
    )


def steady(records: list[dict], key: str) -> list[float]:
    """``key`` of the per-step records after WARMUP, leaving out steps that ran an outer sync."""
    return [r[key] for r in records if key in r and r["step"] > WARMUP and "outer/sync_ms" not in r]


def run_row(overrides: list[str], experiment: str | None, run_dir: Path) -> Measured:
    """Compose and measure one job. A layout or option the config refuses (a tp the model cannot be
    split by, compile with tp) is a row with the refusal, and a job whose worker died a row with
    the worker's error: the other rows still run. Any other refusal is a bug here, and raised."""
    try:
        job = compose_job(overrides, experiment)
    except ConfigError as refusal:
        if not str(refusal).startswith(REFUSABLE):
            raise
        return Measured(note=f"skipped: {refusal}")
    started = time.monotonic()
    try:
        measured = measure(job, run_dir)
    except JobFailed as failure:
        measured = Measured(note=f"failed: {last_error(str(failure))}")
    print(f"{run_dir.name}: {measured} in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    return measured


def last_error(text: str, width: int = 200) -> str:
    """The exception line at the end of a worker's log tail (the last naming an error), cut to ``width``."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Failed)\b", line)]
    line = (errors or lines or ["no log"])[-1]
    return line if len(line) <= width else line[: width - 3] + "..."


def baseline_of(layout: Layout) -> Layout:
    """The FSDP layout with the same groups and workers: what a tp > 1 or pp > 1 layout is compared with."""
    return next(
        b for b in LAYOUTS if b.tp == 1 and b.pp == 1 and (b.groups, b.workers) == (layout.groups, layout.workers)
    )


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 and value == value and base == base else "-"


def layout_table(results: dict[tuple[Layout, Options], Measured]) -> str:
    rows = []
    for (layout, options), m in results.items():
        if m.note:
            rows.append([layout.name, options.label, "-", m.note, "-", "-", "-", "-"])
            continue
        base = results.get((baseline_of(layout), options), Measured())
        rows.append(
            [
                layout.name,
                options.label,
                f"{m.tokens_per_step:,}",
                f"{m.tokens_per_s:,.0f}",
                f"{m.step_ms:,.0f}",
                f"{m.peak_mib:,.0f}",
                ratio(m.tokens_per_s, base.tokens_per_s),
                ratio(m.peak_mib, base.peak_mib),
            ]
        )
    return markdown_table(LAYOUT_HEADERS, rows)


def memory_table(results: dict[str, Measured]) -> str:
    """Each checkpointing mode against ``none``: the drop in peak memory is the activations it saved."""
    none = results["none"]
    rows = []
    for checkpoint, m in results.items():
        if m.note:
            rows.append([checkpoint, m.note, "-", "-", "-"])
            continue
        saved = m.peak_mib - none.peak_mib
        rows.append(
            [
                checkpoint,
                f"{m.tokens_per_s:,.0f}",
                f"{m.peak_mib:,.0f}",
                f"{saved:+,.0f}" if saved == saved else "-",
                ratio(m.tokens_per_s, none.tokens_per_s),
            ]
        )
    return markdown_table(MEMORY_HEADERS, rows)


def bubble_table(one: Measured, pipelines: dict[Layout, Measured]) -> str:
    """Each pipeline's step against one worker's on the same batch: 1 − T1 / (p x Tp) beside (p − 1)/(m + p − 1)."""
    rows = []
    for layout, m in pipelines.items():
        theory = f"{(layout.pp - 1) / (layout.microbatches + layout.pp - 1):.2f}"
        if m.note or one.note:
            rows.append([layout.name, m.note or "-", one.note or f"{one.step_ms:,.0f}", "-", theory])
            continue
        bubble = 1 - one.step_ms / (layout.pp * m.step_ms)
        rows.append([layout.name, f"{m.step_ms:,.0f}", f"{one.step_ms:,.0f}", f"{bubble:.2f}", theory])
    return markdown_table(BUBBLE_HEADERS, rows)


def compile_speedups(results: dict[tuple[Layout, Options], Measured]) -> str:
    """torch.compile's tokens/s against eager with the same layout and checkpointing, one per row pair."""
    parts = []
    for (layout, options), m in results.items():
        eager = results.get((layout, Options(options.checkpoint, False)))
        if options.compile and eager and not m.note and not eager.note:
            parts.append(f"{layout.name}, AC {options.checkpoint}: {ratio(m.tokens_per_s, eager.tokens_per_s)}")
    return "compile / eager tokens/s on this CPU: " + ("; ".join(parts) if parts else "not measured (no compiled row)")


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_line() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"python {platform.python_version()}"
    )


def report(
    setup: str,
    layouts: dict[tuple[Layout, Options], Measured],
    memory: dict[str, Measured],
    memory_setup: str,
    bubble: str,
) -> str:
    lines = [setup, "", layout_table(layouts), "", compile_speedups(layouts), ""]
    if memory:
        lines += [memory_setup, "", memory_table(memory)]
    else:
        lines += ["activation checkpointing on `small`: not measured (--quick, --pipeline)"]
    return "\n".join(lines + ["", bubble])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 eager rows, small batches, no memory table")
    parser.add_argument(
        "--pipeline", action="store_true", help="only FSDP 4 and the pipeline layouts, and the bubble table"
    )
    add_steps_argument(parser)
    add_output_arguments(parser)
    args = parser.parse_args()
    stop_on_sigterm()
    steps = args.steps or (WARMUP + 1 if args.quick else WARMUP + 4)
    if steps <= WARMUP:
        sys.exit(f"--steps={steps}: must exceed the {WARMUP} warm-up steps left out of tokens/s; e.g. {WARMUP + 4}")
    layouts = [layout for layout in LAYOUTS if not args.pipeline or layout.pp > 1 or layout is LAYOUTS[0]]
    rows = QUICK_ROWS if args.quick else [(layout, options) for layout in layouts for options in OPTIONS]
    shape = QUICK_SHAPE if args.quick else []
    load_before, started = load_average(), time.monotonic()
    with runs_root(args.keep_runs, "bench_parallel") as root:
        results = {}
        for layout, options in rows:
            overrides = layout.overrides(steps) + options.overrides() + shape
            run_dir = root / (
                f"{layout.groups}x{layout.workers}-tp{layout.tp}-pp{layout.pp}-{options.checkpoint}-{options.compile}"
            )
            results[(layout, options)] = run_row(overrides, "bench_parallel", run_dir)
        memory = {}
        for checkpoint in [] if args.quick or args.pipeline else SMALL_CHECKPOINTS:
            overrides = SMALL_LAYOUT.overrides(SMALL_STEPS) + Options(checkpoint, False).overrides() + SMALL
            memory[checkpoint] = run_row(overrides, None, root / f"small-{checkpoint}")
        bubble = "pipeline bubble: not measured (--quick)"
        if not args.quick:
            one = run_row(BUBBLE_ONE.overrides(steps) + BUBBLE_SHAPE, "bench_parallel", root / "bubble-one")
            pipelines = {
                layout: run_row(layout.overrides(steps) + BUBBLE_SHAPE, "bench_parallel", root / f"bubble-{i}")
                for i, layout in enumerate(BUBBLE_PIPELINES)
            }
            bubble = "Pipeline bubble, batch 8 x seq 256, eager:\n\n" + bubble_table(one, pipelines)
    job = compose_job(["algo=local", *shape], "bench_parallel")
    small = compose_job(["algo=local", *SMALL])
    setup = (
        f"{machine_line()}; load average (1, 5, 15 min) {load_before} before, {load_average()} after; "
        f"{time.monotonic() - started:.0f}s in all.\n"
        f"Layouts: dim {job.model.dim}, {job.model.n_layers} blocks, {job.model.n_heads} heads / "
        f"{job.model.n_kv_heads} KV heads, MLP {job.model.ffn_dim}; batch {job.trainer.batch_size} x seq "
        f"{job.trainer.seq_len} per dp rank; {steps} steps, tokens/s = median of steps {WARMUP + 1}..{steps}, "
        "summed over groups; peak RSS = largest VmHWM over the job's workers; ratios against the FSDP layout "
        "with the same groups, workers and options."
    )
    memory_setup = (
        f"Activation checkpointing on `small` ({small.model.dim} wide, {small.model.n_layers} blocks) at seq "
        f"{small.trainer.seq_len}, {SMALL_LAYOUT.name}, batch {small.trainer.batch_size} per worker, eager, "
        f"{SMALL_STEPS} steps:"
    )
    text = report(setup, results, memory, memory_setup, bubble)
    print(text)
    print(f"tables written to {write_result('bench_parallel.md', text, args.results)}", file=sys.stderr)


if __name__ == "__main__":
    main()
