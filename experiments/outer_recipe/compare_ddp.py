"""Does DiLoCo train as well as data parallel? Every algorithm at equal tokens, side by side, one table.

``python -m experiments.outer_recipe.compare_ddp [--model mini|midi] [--steps N] [--seeds N] [--only NAME ...] [--quick]``
``python -m experiments.outer_recipe.compare_ddp --collect DIR [DIR ...]``: one table from runs kept (``--keep-runs``)
by earlier invocations, e.g. a long grid split over several sessions or machines.
``--jobs K`` runs up to K jobs at a time, each on a core per worker of its own (a many-core
machine, or ``--device cuda``: jobs that share one GPU). ``--set KEY=VALUE ...`` adds overrides
to every job before each row's own (an earlier default, to reproduce a table recorded with it).

Each configuration is a whole job (``conf/experiment/compare_ddp.yaml`` plus its overrides) run
through the launcher, one after the other on this machine: ``ddp`` (gradients all-reduced
every step: the quality DiLoCo aims for), ``local`` (groups that never communicate: the floor
DiLoCo must beat), DiLoCo at several H and M, with the mixing α ramped (the default), off,
from the first round and (at M=4) not scaled down by the number of groups, the paper's exact
settings, Streaming DiLoCo (P=4, τ=1, fp4; α on and off), and SparseLoCo's error-feedback top-k
(``algo.compress=topk``) at several densities and H, and MuLoCo's rows (``inner_opt=muon``: Muon as
the inner optimizer, each against data parallel and local with Muon too), and at the seed's group
counts (M = 8, 16, 30) data parallel at several inner learning rates (``ddp, lr 0.006``: the ratios
and gaps are against the best of them), local, DiLoCo and the sparse recipe. Every group reads its own shard
and takes the same inner steps, so at M groups every configuration sees the same tokens.

``--seeds N`` runs every configuration at ``trainer.seed`` 0 .. N−1 (other initial weights and
data order; ``--first-seed S`` starts at S). The table gives, over the seeds, the mean, worst
and spread of the final eval loss of the job's global model, its ratio to ddp with as many groups
and the gap closed, (local − x)/(local − ddp) against ddp and local at the same seed (mean and
worst), and bytes sent per token; a second table gives every seed's loss. The PNG draws eval
loss against the job's tokens, the mean over the seeds with a band from the best to the worst
(group 0's model at each evaluation: with ``trainer.eval_every`` a multiple of H it is evaluated
right after a sync, so for DiLoCo it is the global model, or with α > 0 the group's mix of it
and its own weights; the final loss is always the global model's);
a second PNG draws every run's final eval loss against its bytes per token (log scale).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.config.job import JobConfig
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
    write_result,
)

EXPERIMENT = "compare_ddp"
CONFIG_FILE = "compare_ddp.json"  # in each run directory: which row of the table it is
EVAL_EVERY = 100  # a multiple of every H below: DiLoCo is evaluated right after a sync


@dataclass(frozen=True)
class Config:
    """One row: a job with ``groups`` groups and these overrides."""

    name: str
    groups: int
    overrides: tuple[str, ...]

    @property
    def algo(self) -> str:
        return next(o.split("=", 1)[1] for o in self.overrides if o.startswith("algo="))

    @property
    def inner(self) -> str:
        """The inner optimizer: ``adamw`` (the default) or the ``inner_opt=`` preset a row names."""
        return next((o.split("=", 1)[1] for o in self.overrides if o.startswith("inner_opt=")), "adamw")

    @property
    def family(self) -> str:
        """The plot's marker: the algorithm, or sparseloco for a compressed DiLoCo."""
        return "sparseloco" if "algo.compress=topk" in self.overrides else self.algo


def _diloco(h: int, groups: int = 2, *extra: str, name: str = "") -> Config:
    return Config(name or f"diloco H={h}", groups, ("algo=diloco", f"algo.sync_every={h}", *extra))


SPARSELOCO = {"algo.alpha": "0", "outer_opt": "sgd", "outer_opt.lr": "1", "outer_opt.momentum": "0"}
RAMPED_WHATEVER_M = {"algo.alpha": None, "algo.alpha_reference_groups": "0"}
PLAIN_MEAN = {"algo.sparse_reference_groups": "0"}
DILOCO_OUTER = {"algo.alpha": None, "outer_opt": None, "outer_opt.lr": None, "outer_opt.momentum": None}


def _sparse(
    h: int, density: float, groups: int = 2, bits: int = 2, name: str = "", changes: dict[str, str | None] | None = None
) -> Config:
    """SparseLoCo (arXiv 2508.15706): chunked top-k with error feedback. By default its recipe: e is
    the momentum, so the outer step is plain SGD with lr 1, and α = 0 (what was not sent lives in e,
    not in θ_l); ``changes`` set other keys (None: the job's default)."""
    keys = {"algo.compress": "topk", "algo.density": str(density), "algo.value_bits": str(bits)}
    keys |= SPARSELOCO | (changes or {})
    overrides = ("algo=diloco", f"algo.sync_every={h}", *(f"{k}={v}" for k, v in keys.items() if v is not None))
    return Config(f"sparseloco H={h} {100 * density:g}% {bits}-bit{name}", groups, overrides)


MANY_GROUPS = (8, 16, 30)
DDP_LRS = ("0.00075", "0.0015", "0.006")  # around the inner lr every other row trains with (3e-3)
STREAMING = ("algo=streaming", "algo.sync_every=100", "algo.fragments=4", "algo.delay=1", "algo.quantize=fp4")
CONFIGS = [
    Config("ddp", 2, ("algo=ddp",)),
    Config("local", 2, ("algo=local",)),
    _diloco(10),
    _diloco(50),
    _diloco(100),
    _diloco(50, 2, "algo.alpha=0", name="diloco H=50, α=0"),
    _diloco(50, 2, "algo.alpha_warmup_steps=0", name="diloco H=50, α=0.5 from the first round"),
    _diloco(50, 2, "outer_opt.momentum_warmup_steps=0", "algo.alpha=0", name="diloco H=50, paper's settings"),
    _diloco(50, 2, "outer_opt.lr=1.0", name="diloco H=50, outer lr 1"),
    _diloco(50, 2, "outer_opt.lr=1.0", "algo.alpha=0", name="diloco H=50, outer lr 1, α=0"),
    _diloco(50, 2, "outer_opt.momentum_warmup_steps=500", name="diloco H=50, μ warm-up 500 steps"),
    _diloco(50, 2, "algo.alpha_warmup_steps=2000", name="diloco H=50, α warm-up 2000 steps"),
    _diloco(50, 2, "algo.sync_warmup_steps=0", name="diloco H=50, no H warm-up"),
    _diloco(50, 2, "algo.sync_warmup_steps=1000", name="diloco H=50, H₀=10 for 1000 steps"),
    # The groups' models averaged every inner step or every 5: where does the distance to ddp come from?
    *(
        _diloco(
            h, 2, "algo.sync_warmup_steps=0", "outer_opt=avg", "algo.alpha=0", name=f"local SGD H={h} (the plain mean)"
        )
        for h in (1, 5)
    ),
    Config("streaming H=100 P=4 τ=1 fp4", 2, STREAMING),
    _diloco(100, 2, "algo.sync_warmup_every=20", name="diloco H=100, H₀=20"),
    _diloco(100, 2, "algo.sync_warmup_steps=0", name="diloco H=100, no H warm-up"),
    Config("streaming H=100 P=4 τ=1 fp4, no H warm-up", 2, (*STREAMING, "algo.sync_warmup_steps=0")),
    Config("streaming H=100 P=4 τ=1 fp4, α=0", 2, (*STREAMING, "algo.alpha=0")),
    Config("streaming H=100 P=4 τ=1 fp32", 2, (*STREAMING, "algo.quantize=none")),
    Config("streaming H=100 P=4 τ=0 fp32, α=0", 2, (*STREAMING, "algo.quantize=none", "algo.delay=0", "algo.alpha=0")),
    Config("ddp", 4, ("algo=ddp",)),
    Config("local", 4, ("algo=local",)),
    _diloco(50, 4),
    _diloco(50, 4, "algo.alpha=0", name="diloco H=50, α=0"),
    _diloco(50, 4, "algo.alpha_reference_groups=0", name="diloco H=50, α=0.5 whatever M"),
    _diloco(50, 4, "outer_opt.lr=1.0", name="diloco H=50, outer lr 1"),
    _diloco(50, 4, "algo.alpha_warmup_steps=2000", name="diloco H=50, α warm-up 2000 steps"),
    _diloco(50, 4, "algo.sync_warmup_steps=0", name="diloco H=50, no H warm-up"),
    _diloco(50, 2, "algo.quantize=fp4", name="diloco H=50 fp4"),
    *(_sparse(h, d) for h in (20, 25, 50) for d in (0.01, 0.02, 0.03)),
    _sparse(50, 0.02, name=", α ramped", changes={"algo.alpha": None}),
    *(_sparse(20, d, name=", α ramped", changes={"algo.alpha": None}) for d in (0.01, 0.03)),
    *(
        _sparse(
            20, density, groups, name=f", α ramped, outer lr {lr}", changes={"algo.alpha": None, "outer_opt.lr": lr}
        )
        for density, groups, lr in [
            (0.01, 2, "1.5"),
            (0.01, 2, "2"),
            (0.01, 2, "2.5"),
            (0.012, 2, "1.5"),
            (0.01, 4, "1.5"),
            (0.01, 4, "1.75"),
            (0.01, 4, "2"),
            (0.012, 4, "1.5"),
            (0.02, 4, "1.75"),
        ]
    ),
    # Does what e holds back go stale as the inner lr anneals? A shorter memory for it (β 0.9, not 0.95).
    _sparse(
        20,
        0.01,
        4,
        name=", α ramped, outer lr 1.75, β=0.9",
        changes={"algo.alpha": None, "outer_opt.lr": "1.75", "algo.error_decay": "0.9"},
    ),
    # Seeds 2 and 3 trail DiLoCo from the first 1,000 steps: windows of H₀ = 10 for twice as long.
    _sparse(
        20,
        0.01,
        4,
        name=", α ramped, outer lr 1.75, H₀=10 for 1000 steps",
        changes={"algo.alpha": None, "outer_opt.lr": "1.75", "algo.sync_warmup_steps": "1000"},
    ),
    _sparse(20, 0.01, 4, name=", α ramped", changes={"algo.alpha": None}),
    # At M = 4 the default α is scaled by (2/M)² to 0.125: θ_l keeps less of what e holds back.
    _sparse(20, 0.01, 4, name=", α=0.5 whatever M", changes=RAMPED_WHATEVER_M),
    *(
        _sparse(
            20, 0.01, 4, name=f", α=0.5 whatever M, outer lr {lr}", changes=RAMPED_WHATEVER_M | {"outer_opt.lr": lr}
        )
        for lr in ("1.5", "2")
    ),
    # Before algo.sparse_reference_groups (docs/notes/sparseloco.md): the plain mean, the outer lr in its place.
    _sparse(20, 0.01, 4, name=", α ramped, plain mean", changes={"algo.alpha": None} | PLAIN_MEAN),
    _sparse(20, 0.01, 4, name=", α=0.5 whatever M, plain mean", changes=RAMPED_WHATEVER_M | PLAIN_MEAN),
    *(
        _sparse(
            20, 0.01, 4, name=f", {alpha}, plain mean, outer lr {lr}", changes=keys | PLAIN_MEAN | {"outer_opt.lr": lr}
        )
        for alpha, keys, lr in [
            ("α ramped", {"algo.alpha": None}, "2"),
            ("α=0.5 whatever M", RAMPED_WHATEVER_M, "2"),
            ("α=0.5 whatever M", RAMPED_WHATEVER_M, "3"),
            ("α=0.5 whatever M", RAMPED_WHATEVER_M, "4"),
        ]
    ),
    _sparse(20, 0.02, 4, name=", α=0.5 whatever M, plain mean", changes=RAMPED_WHATEVER_M | PLAIN_MEAN),
    _sparse(50, 0.02, name=", DiLoCo's outer step", changes=DILOCO_OUTER),
    _sparse(50, 0.02, name=", DiLoCo's outer step, β=0", changes=DILOCO_OUTER | {"algo.error_decay": "0"}),
    _sparse(50, 0.02, 4),
    # MuLoCo (arXiv 2505.23725): Muon as the inner optimizer (conf/inner_opt/muon.yaml), each row
    # against the data-parallel and local runs with Muon too; lr rows tune it once at 1,000 steps.
    *(
        Config(f"{algo}, muon", groups, (f"algo={algo}", "inner_opt=muon"))
        for groups in (2, 4)
        for algo in ("ddp", "local")
    ),
    *(_diloco(50, groups, "inner_opt=muon", name="diloco H=50, muon") for groups in (2, 4)),
    *(
        Config(f"ddp, muon lr {lr}", 2, ("algo=ddp", "inner_opt=muon", f"inner_opt.lr={lr}"))
        for lr in (0.0025, 0.005, 0.01, 0.04)
    ),
    *(
        _diloco(50, 2, "inner_opt=muon", f"inner_opt.lr={lr}", name=f"diloco H=50, muon lr {lr}")
        for lr in (0.0025, 0.005, 0.01, 0.04)
    ),
    # The M = 4 sparse row measured best with AdamW (outer lr 1.75), with Muon inside; then its
    # density and outer lr, the knobs that moved it with AdamW; then, at the best of those, H and
    # the values' bits.
    *(
        _sparse(
            h,
            density,
            4,
            bits,
            name=f", α ramped, outer lr {lr}, muon",
            changes={"algo.alpha": None, "outer_opt.lr": lr, "inner_opt": "muon"},
        )
        for h, density, bits, lr in [
            (20, 0.01, 2, "1.75"),
            (20, 0.03, 2, "1.75"),
            (20, 0.05, 2, "1.75"),
            (20, 0.01, 2, "2.5"),
            (20, 0.03, 2, "1.25"),
            (20, 0.03, 2, "1"),
            (20, 0.05, 2, "1.25"),
            (10, 0.03, 2, "1.25"),
            (20, 0.03, 4, "1.25"),
        ]
    ),
    # At 3% and outer lr 1.25, what the unsent part of Δ does: all of it sent in time (β = 1), none
    # kept in θ_l (α = 0, SparseLoCo's own); then DiLoCo's Nesterov outer step on what is sent.
    _sparse(
        20,
        0.03,
        4,
        name=", α ramped, β=1, outer lr 1.25, muon",
        changes={"algo.alpha": None, "algo.error_decay": "1", "outer_opt.lr": "1.25", "inner_opt": "muon"},
    ),
    _sparse(20, 0.03, 4, name=", α=0, outer lr 1.25, muon", changes={"outer_opt.lr": "1.25", "inner_opt": "muon"}),
    _sparse(20, 0.03, 4, name=", DiLoCo's outer step, muon", changes=DILOCO_OUTER | {"inner_opt": "muon"}),
    # Density has moved it most: 10%, and where the recipe's outer step leads as density reaches 1
    # (dense DiLoCo at H = 20 with plain SGD, lr 1.25, no momentum: what e and top-k leave).
    *(
        _sparse(
            20,
            0.1,
            4,
            name=f", α ramped, outer lr {lr}, muon",
            changes={"algo.alpha": None, "outer_opt.lr": lr, "inner_opt": "muon"},
        )
        for lr in ("1", "1.25")
    ),
    _diloco(
        20,
        4,
        "inner_opt=muon",
        "outer_opt=sgd",
        "outer_opt.lr=1.25",
        "outer_opt.momentum=0",
        name="diloco H=20, outer SGD lr 1.25, muon",
    ),
    # The seed's group counts: data parallel with its inner lr tuned (M times the batch may want
    # another lr; ``baseline`` keeps the best), local, DiLoCo with the defaults and with the outer
    # settings the M-rules bear on (α, the outer lr, the sync warm-up's length), and the sparse recipe
    # measured best at M = 4.
    *(
        row
        for groups in MANY_GROUPS
        for row in (
            Config("ddp", groups, ("algo=ddp",)),
            *(Config(f"ddp, lr {lr}", groups, ("algo=ddp", f"inner_opt.lr={lr}")) for lr in DDP_LRS),
            Config("local", groups, ("algo=local",)),
            _diloco(50, groups),
            _diloco(50, groups, "algo.alpha=0", name="diloco H=50, α=0"),
            _diloco(50, groups, "algo.alpha_reference_groups=0", name="diloco H=50, α=0.5 whatever M"),
            _diloco(50, groups, "outer_opt.lr=1.0", name="diloco H=50, outer lr 1"),
            _diloco(50, groups, "algo.sync_warmup_steps=0", name="diloco H=50, no H warm-up"),
            _diloco(50, groups, "algo.sync_warmup_steps=200", name="diloco H=50, H₀=10 for 200 steps"),
            _diloco(50, groups, "algo.sync_warmup_steps=1000", name="diloco H=50, H₀=10 for 1000 steps"),
            _sparse(
                20, 0.01, groups, name=", α ramped, outer lr 1.75", changes={"algo.alpha": None, "outer_opt.lr": "1.75"}
            ),
        )
    ),
]
QUICK_STEPS = 100
QUICK_BATCH = ["trainer.batch_size=4", "trainer.seq_len=64"]  # a smoke run: start-up dominates anyway


@dataclass
class RunResult:
    """What the table and the plot need from one finished job's run directory."""

    config: Config
    summary: dict[str, Any]
    curve: list[tuple[float, float]]  # (job tokens, eval loss of group 0's model)
    seed: int = 0
    inner_lr: float = math.nan  # as the job resolved it (job.json)

    @property
    def loss(self) -> float:
        return self.summary["final_eval_loss"] if self.summary.get("ok") else float("nan")


def collect(config: Config, run_dir: Path, seed: int = 0) -> RunResult:
    """Read a finished job's summary.json and group 0's evaluations."""
    paths = RunPaths(run_dir)
    summary = json.loads(paths.summary.read_text())
    tokens_per_step = summary["tokens_seen"] / max(summary["steps"], 1)  # the whole job's, every group
    curve = [(r["step"] * tokens_per_step, r["eval/loss"]) for r in read_jsonl(paths.metrics(0)) if "eval/loss" in r]
    curve.append((summary["tokens_seen"], summary["final_eval_loss"]))
    inner_lr = json.loads(paths.job.read_text())["inner_opt"]["lr"]
    return RunResult(config, summary, sorted(dict(curve).items()), seed, inner_lr)


def kept_by_shape(roots: list[Path]) -> dict[tuple[str, int, str], list[RunResult]]:
    """Every finished run under ``roots`` that names its row (``CONFIG_FILE``), by the model, steps
    and device it ran with, each list in the table's order."""
    order = {(c.name, c.groups): i for i, c in enumerate(CONFIGS)}
    found: dict[tuple[str, int, str], list[RunResult]] = {}
    for marker in sorted(m for root in roots for m in root.glob(f"**/{CONFIG_FILE}")):
        if RunPaths(marker.parent).summary.exists():
            saved = json.loads(marker.read_text())
            config = Config(saved["name"], saved["groups"], tuple(saved["overrides"]))
            shape = (saved["model"], saved["steps"], saved.get("device", "cpu"))
            found.setdefault(shape, []).append(collect(config, marker.parent, saved.get("seed", 0)))

    def position(r: RunResult) -> tuple[int, str, int]:
        return order.get((r.config.name, r.config.groups), len(order)), r.config.name, r.seed

    return {shape: sorted(runs, key=position) for shape, runs in found.items()}


def collect_kept(roots: list[Path]) -> tuple[list[RunResult], str, int, str]:
    """The runs kept under ``roots`` and the model, steps and device they share (runs of another
    shape are refused: one table compares one model at one length)."""
    found = kept_by_shape(roots)
    if len(found) != 1:
        sys.exit(f"--collect: need finished runs of one model, length and device under {roots}, found {sorted(found)}")
    [(model, steps, device)] = found
    return found[model, steps, device], model, steps, device


def baseline_runs(results: list[RunResult], algo: str, groups: int, seed: int, inner: str = "adamw") -> list[RunResult]:
    """The finished runs of the ``algo`` row (``ddp`` or ``local``; ``ddp, muon`` with another inner
    optimizer) with ``groups`` groups at ``seed``, with its inner-lr variants (``ddp, lr 0.006``)."""
    name = algo if inner == "adamw" else f"{algo}, {inner}"
    return [
        r
        for r in results
        if (r.config.name == name or r.config.name.startswith(f"{name}, lr "))
        and r.config.groups == groups
        and r.seed == seed
        and math.isfinite(r.loss)
    ]


def baseline(results: list[RunResult], algo: str, groups: int, seed: int, inner: str = "adamw") -> float | None:
    """The loss of the ``algo`` row with ``groups`` groups at ``seed``, the best of its inner learning
    rates where several ran (tuned data parallel); None if there is none or every one failed."""
    found = baseline_runs(results, algo, groups, seed, inner)
    return min(r.loss for r in found) if found else None


def gap_closed(results: list[RunResult], run: RunResult, inner: str | None = None) -> float | None:
    """(local − x)/(local − ddp) against the baselines with as many groups, the same seed and the
    same inner optimizer as ``run`` (or ``inner``'s)."""
    inner = inner or run.config.inner
    ddp, local = (baseline(results, algo, run.config.groups, run.seed, inner) for algo in ("ddp", "local"))
    if not (math.isfinite(run.loss) and ddp and local and local != ddp):
        return None
    return (local - run.loss) / (local - ddp)


def vs_ddp(results: list[RunResult], run: RunResult) -> float | None:
    """x / ddp − 1 against data parallel with as many groups, the same seed and inner optimizer."""
    ddp = baseline(results, "ddp", run.config.groups, run.seed, run.config.inner)
    return run.loss / ddp - 1 if ddp and math.isfinite(run.loss) else None


@dataclass
class Row:
    """One configuration over its seeds: the table's row, the targets' and the plot's unit."""

    config: Config
    runs: list[RunResult]
    closed: list[float]  # gap closed at each seed that has both baselines
    ratios: list[float]  # x / ddp − 1 at each seed that has ddp

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.runs]

    @property
    def failed(self) -> list[RunResult]:
        return [r for r in self.runs if not r.summary.get("ok")]


def by_config(results: list[RunResult]) -> list[Row]:
    """The runs grouped by configuration, in the order their first run appears."""
    grouped: dict[tuple[str, int], list[RunResult]] = {}
    for r in results:
        grouped.setdefault((r.config.name, r.config.groups), []).append(r)
    out = []
    for runs in grouped.values():
        runs = sorted(runs, key=lambda r: r.seed)
        closed = [c for c in (gap_closed(results, r) for r in runs) if c is not None]
        ratios = [v for v in (vs_ddp(results, r) for r in runs) if v is not None]
        out.append(Row(runs[0].config, runs, closed, ratios))
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _percent(values: list[float], summary: Any, fmt: str = ".0f") -> str:
    """``summary`` (mean, min or max) of ``values`` as a percentage; "–" where there are none."""
    return f"{100 * summary(values):{fmt}}%" if values else "–"


def rows(results: list[RunResult]) -> list[list[str]]:
    """One row per configuration: over its seeds, the mean, worst and spread of the loss, the
    mean ratio to ddp, and the mean and worst gap closed (each seed against its own baselines)."""
    out = []
    for row in by_config(results):
        losses = row.losses
        finite = [v for v in losses if math.isfinite(v)]
        failed = "; ".join(f"seed {r.seed}: {r.summary.get('failure')}" for r in row.failed)
        out.append(
            [
                row.config.name + (f" (failed: {failed})" if failed else ""),
                str(row.config.groups),
                str(len(row.runs)),
                f"{_mean(losses):.4f}",
                f"{max(losses):.4f}" if not failed else "nan",
                f"{max(finite) - min(finite):.4f}" if finite else "nan",
                _percent(row.ratios, _mean, "+.1f"),
                _percent(row.closed, _mean),
                _percent(row.closed, min),
                f"{_mean([r.summary['bytes_per_token'] for r in row.runs]):.1f}",
                f"{_mean([r.summary['wall_seconds'] for r in row.runs]) / 60:.1f}",
            ]
        )
    return out


def table(results: list[RunResult]) -> str:
    headers = [
        "config",
        "M",
        "seeds",
        "eval loss, mean",
        "worst",
        "spread",
        "vs ddp",
        "gap closed, mean",
        "worst",
        "bytes/token",
        "wall min",
    ]
    return markdown_table(headers, rows(results))


def seed_table(results: list[RunResult]) -> str:
    """Every seed's final eval loss (and gap closed) per configuration: what the means hide."""
    seeds = sorted({r.seed for r in results})
    body = []
    for row in by_config(results):
        at = {r.seed: r for r in row.runs}
        cells = []
        for seed in seeds:
            run = at.get(seed)
            closed = gap_closed(results, run) if run else None
            cells.append(
                "" if run is None else f"{run.loss:.4f}" + (f" ({100 * closed:.0f}%)" if closed is not None else "")
            )
        body.append([row.config.name, str(row.config.groups), *cells])
    return markdown_table(["config", "M", *(f"seed {s}" for s in seeds)], body)


def _muon_targets(results: list[RunResult], found: dict[tuple[str, int], Row]) -> list[str]:
    """Muon-inner DiLoCo H=50: the gap closed against data parallel with Muon and against the better
    of the two data-parallel runs (each seed's), and against AdamW-inner DiLoCo at the same seed."""
    lines = []
    for groups in (2, 4):
        muon, adamw = found.get(("diloco H=50, muon", groups)), found.get(("diloco H=50", groups))
        if not (muon and muon.closed):
            continue
        best = []
        for run in muon.runs:
            closed = [gap_closed(results, run, inner) for inner in ("adamw", "muon")]
            ddps = [baseline(results, "ddp", groups, run.seed, inner) for inner in ("adamw", "muon")]
            if None not in closed and None not in ddps:
                best.append(closed[ddps.index(min(ddps))])
        line = f"- gap closed by Muon-inner DiLoCo M={groups} H=50: mean {100 * _mean(muon.closed):.0f}% against ddp with Muon"
        if best:
            line += f", {100 * _mean(best):.0f}% against the better ddp of the two"
        if adamw:
            pairs = [m.loss / a.loss - 1 for m in muon.runs for a in adamw.runs if m.seed == a.seed]
            if pairs:
                line += f"; against AdamW-inner DiLoCo worst {100 * max(pairs):+.1f}%"
        lines.append(line)
    return lines


def _sparse_with_muon(found: dict[tuple[str, int], Row], groups: int) -> list[str]:
    """Each sparse row with Muon inside against DiLoCo H=50 with Muon at M groups, seed by seed."""
    dense = found.get(("diloco H=50, muon", groups))
    lines = []
    for row in found.values():
        if dense and row.config.family == "sparseloco" and row.config.inner == "muon" and row.config.groups == groups:
            ratios = [s.loss / d.loss - 1 for s in row.runs for d in dense.runs if s.seed == d.seed]
            if ratios:
                lines.append(
                    f"- M={groups}: {row.config.name} against DiLoCo H=50 with Muon: "
                    f"mean {100 * _mean(ratios):+.1f}%, worst {100 * max(ratios):+.1f}%"
                )
    return lines


def targets(results: list[RunResult]) -> list[str]:
    """The targets that this table decides (means and worst over the seeds): the gap closed
    at H=50, never worse than local, M=4 against ddp, Streaming against DiLoCo at the same H."""
    lines = []
    found = {(row.config.name, row.config.groups): row for row in by_config(results)}
    default = found.get(("diloco H=50", 2))
    if default and default.closed:
        lines.append(
            f"- gap closed by DiLoCo M=2 H=50 with the defaults: mean {100 * _mean(default.closed):.0f}%, "
            f"worst {100 * min(default.closed):.0f}% ({len(default.closed)} seeds)"
        )
    if any(r.config.algo == "local" for r in results):
        worse = [
            f"{r.config.name} M={r.config.groups} seed {r.seed}"
            for r in results
            if r.config.family in ("diloco", "streaming")
            and (local := baseline(results, "local", r.config.groups, r.seed, r.config.inner))
            and r.loss > local
        ]
        lines.append(f"- DiLoCo worse than local: {', '.join(worse) if worse else 'none'}")
    lines += _muon_targets(results, found)
    lines += [line for groups in (2, 4) for line in _sparse_with_muon(found, groups)]
    for groups in (4, *MANY_GROUPS):
        lines += _tuned_ddp(results, groups)
        many = found.get(("diloco H=50", groups))
        if many and many.ratios:
            lines.append(
                f"- DiLoCo M={groups} H=50 against ddp: mean {100 * _mean(many.ratios):+.1f}%, "
                f"worst {100 * max(many.ratios):+.1f}%"
            )
    stream, same_h = found.get(("streaming H=100 P=4 τ=1 fp4", 2)), found.get(("diloco H=100", 2))
    if stream and same_h:
        pairs = [(s.loss, d.loss) for s in stream.runs for d in same_h.runs if s.seed == d.seed]
        if pairs:
            ratios = [s / d - 1 for s, d in pairs]
            lines.append(
                f"- streaming vs DiLoCo at H=100: mean {100 * _mean(ratios):+.2f}%, worst {100 * max(ratios):+.2f}%"
            )
    lines += [_sparse_target(found, groups) for groups in (2, 4)]
    return [line for line in lines if line]


def _tuned_ddp(results: list[RunResult], groups: int) -> list[str]:
    """Which inner lr the data-parallel baseline at M groups kept, per seed (where several ran)."""
    lines = []
    for seed in sorted({r.seed for r in results}):
        runs = baseline_runs(results, "ddp", groups, seed)
        if len(runs) > 1:
            lrs = {r.inner_lr: r.loss for r in runs}
            tried = ", ".join(f"{lr:g}: {loss:.4f}" for lr, loss in sorted(lrs.items()))
            lines.append(f"- ddp M={groups} seed {seed}: inner lr {min(lrs, key=lrs.get):g} kept (of {tried})")
    return lines


def _sparse_target(found: dict[tuple[str, int], Row], groups: int) -> str:
    """The sparse target: the sparse row with the lowest mean loss among those sending >= 3,000x fewer
    bytes per token than ddp, against DiLoCo H=50 with the defaults, at M groups ("" without those runs).
    ``found``: the table's rows by (name, M)."""
    ddp = next((row for row in found.values() if row.config.algo == "ddp" and row.config.groups == groups), None)
    default = found.get(("diloco H=50", groups))
    sparse = [row for row in found.values() if row.config.family == "sparseloco" and row.config.groups == groups]
    if not (ddp and default and sparse):
        return ""
    ddp_bytes = ddp.runs[0].summary["bytes_per_token"]
    ratio = {row.config.name: ddp_bytes / row.runs[0].summary["bytes_per_token"] for row in sparse}
    frugal = [row for row in sparse if ratio[row.config.name] >= 3000 and math.isfinite(_mean(row.losses))]
    if not frugal:
        return f"- M={groups}: no sparse row sends 3,000x fewer bytes per token than ddp"
    best = min(frugal, key=lambda row: _mean(row.losses))
    return (
        f"- M={groups}: {best.config.name} sends {ratio[best.config.name]:,.0f}x fewer bytes per token than ddp, "
        f"loss {100 * (_mean(best.losses) / _mean(default.losses) - 1):+.2f}% against DiLoCo H=50"
    )


def band(row: Row) -> tuple[list[float], list[float], list[float], list[float]]:
    """The row's curves over its seeds at the tokens every seed evaluated: (tokens, mean, best, worst)."""
    curves = [dict(r.curve) for r in row.runs if r.curve]
    shared = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    values = [[c[t] for c in curves] for t in shared]
    return shared, [_mean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def plot(results: list[RunResult], path: Path, title: str) -> str:
    """Eval loss against the job's tokens, one panel per M: each configuration's mean over its
    seeds, and a band from its best to its worst seed."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    group_counts = sorted({r.config.groups for r in results})
    fig, axes = plt.subplots(1, len(group_counts), figsize=(6.5 * len(group_counts), 4.8), squeeze=False)
    for ax, groups in zip(axes[0], group_counts):
        shown = []
        for row in (row for row in by_config(results) if row.config.groups == groups):
            tokens, mean, best, worst = band(row)
            millions = [t / 1e6 for t in tokens]
            style = {"ls": "--", "color": "black"} if row.config.algo in ("ddp", "local") else {}
            if row.config.algo == "local":
                style["color"] = "grey"
            (line,) = ax.plot(millions, mean, lw=1.3, label=f"{row.config.name} ({len(row.runs)} seeds)", **style)
            ax.fill_between(millions, best, worst, color=line.get_color(), alpha=0.15, lw=0)
            shown += worst
        shown.sort()
        if shown:
            ax.set_ylim(0.97 * shown[0], shown[int(0.9 * (len(shown) - 1))])
        ax.set_title(f"M={groups} groups", loc="left")
        ax.set_xlabel("tokens (millions, all groups)")
        ax.set_ylabel("eval loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 60 * len(group_counts)), fontsize=9)
    return save_figure(fig, path)


def plot_bytes(results: list[RunResult], path: Path, title: str) -> str:
    """Final eval loss (mean over seeds) against bytes sent per token (log scale), one panel per M;
    local (no bytes) is a line."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    group_counts = sorted({r.config.groups for r in results})
    fig, axes = plt.subplots(1, len(group_counts), figsize=(6.5 * len(group_counts), 4.8), squeeze=False)
    for ax, groups in zip(axes[0], group_counts):
        for row in (row for row in by_config(results) if row.config.groups == groups):
            loss, sent = _mean(row.losses), row.runs[0].summary["bytes_per_token"]
            if not math.isfinite(loss):
                continue
            if sent > 0:
                ax.scatter(sent, loss, s=18, marker=_MARKERS.get(row.config.family, "o"))
                ax.annotate(row.config.name, (sent, loss), fontsize=6, alpha=0.8)
            else:
                ax.axhline(loss, ls="--", color="grey", lw=1, label=row.config.name)
        ax.set_xscale("log")
        ax.set_title(f"M={groups} groups", loc="left")
        ax.set_xlabel("bytes sent per token (log)")
        ax.set_ylabel("final eval loss (nats/byte)")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:  # only local's line has a label
            ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 60 * len(group_counts)), fontsize=9)
    return save_figure(fig, path)


_MARKERS = {"ddp": "s", "diloco": "o", "streaming": "^", "sparseloco": "*"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mini", help="conf/model preset (mini: 0.8M, midi: 4.6M parameters)")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps of every job, a multiple of 100")
    parser.add_argument("--seeds", type=int, default=1, help="run every configuration at this many trainer.seed values")
    parser.add_argument("--first-seed", type=int, default=0, help="the first of them (default 0)")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run only these configurations (names as in the table)"
    )
    parser.add_argument("--groups", type=int, nargs="+", metavar="M", help="run only the configurations with M groups")
    parser.add_argument(
        "--jobs", type=int, default=1, help="run up to this many jobs at a time, each on a core per worker of its own"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cluster.device of every job")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="overrides for every job, before each row's own (e.g. an earlier default, to reproduce its table)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny model, {QUICK_STEPS} steps of 4 x 64 tokens, ddp/local/diloco M=2: a smoke test",
    )
    parser.add_argument(
        "--collect", nargs="+", metavar="DIR", type=Path, help="run nothing: one table from runs kept under DIR"
    )
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.first_seed < 0 or args.jobs < 1:
        parser.error("--seeds and --jobs must be >= 1, --first-seed >= 0")
    return args


def chosen(args: argparse.Namespace) -> list[Config]:
    if args.quick:
        return [c for c in CONFIGS if c.groups == 2 and c.name in ("ddp", "local", "diloco H=50")]
    unknown = set(args.only or []) - {c.name for c in CONFIGS}
    if unknown:
        sys.exit(f"--only: unknown configuration(s) {sorted(unknown)}; known: {sorted({c.name for c in CONFIGS})}")
    return [
        c for c in CONFIGS if (not args.only or c.name in args.only) and (not args.groups or c.groups in args.groups)
    ]


@dataclass(frozen=True)
class Planned:
    """One job of the grid: a configuration at a seed, composed, and where it runs."""

    config: Config
    seed: int
    job: JobConfig
    run_dir: Path
    marker: dict[str, Any]  # CONFIG_FILE's contents: what ``--collect`` reads back


def shared_overrides(model: str, steps: int, device: str, quick: bool = False) -> list[str]:
    """What every job of one invocation shares: the model, its length, evaluations every
    ``EVAL_EVERY`` steps, the device (and ``--quick``'s small batches)."""
    shared = [f"model={model}", f"trainer.max_steps={steps}", f"trainer.eval_every={EVAL_EVERY}"]
    return shared + [f"cluster.device={device}", *(QUICK_BATCH if quick else [])]


def plan(args: argparse.Namespace, root: Path, shared: list[str], model: str, steps: int) -> list[Planned]:
    """Every chosen configuration at every seed, seed by seed (so a cut-short grid has whole seeds)."""
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    out = []
    for seed in seeds:
        for config in chosen(args):
            overrides = [*shared, *args.set, f"cluster.groups={config.groups}", f"trainer.seed={seed}"]
            overrides += config.overrides  # last: a row's own setting beats --set
            marker = dataclasses.asdict(config) | {"model": model, "steps": steps, "seed": seed}
            marker |= {"device": args.device, "set": args.set}  # --set is recorded, not part of the row's name
            job = compose_job(overrides, EXPERIMENT)
            out.append(Planned(config, seed, job, root / f"run{len(out)}", marker))
    return out


def run_planned(planned: Planned) -> RunResult:
    """Run one job of the grid and read it back (in this process or a ``--jobs`` worker)."""
    started = time.monotonic()
    run_job(planned.job, planned.run_dir, keep_failure=True)
    (planned.run_dir / CONFIG_FILE).write_text(json.dumps(planned.marker))
    result = collect(planned.config, planned.run_dir, planned.seed)
    print(
        f"{planned.config.name} M={planned.config.groups} seed {planned.seed}: eval {result.loss:.4f} "
        f"in {(time.monotonic() - started) / 60:.1f} min",
        file=sys.stderr,
        flush=True,
    )
    return result


class CorePool:
    """This process's cores, lent to concurrent jobs: a job takes one core per worker (all of them at
    most) and gives them back when it ends, so jobs of 4 and of 2 groups share the cores without
    overlap, and ``threads_per_worker`` divides a job's own cores between its workers."""

    def __init__(self, context: Any) -> None:
        self.cores = sorted(os.sched_getaffinity(0))
        self.free = context.Queue()
        for core in self.cores:
            self.free.put(core)
        self.taking = context.Lock()  # one job takes its cores at a time: no two half-served jobs wait on each other

    @contextlib.contextmanager
    def lend(self, wanted: int) -> Iterator[set[int]]:
        with self.taking:
            cores = {self.free.get() for _ in range(min(wanted, len(self.cores)))}
        try:
            yield cores
        finally:
            for core in cores:
                self.free.put(core)


_POOL: CorePool | None = None  # in a ``--jobs`` worker process: where its jobs' cores come from


def _join_pool(pool: CorePool) -> None:
    global _POOL
    stop_on_sigterm()
    _POOL = pool


def run_pinned(planned: Planned) -> RunResult:
    """``run_planned`` on cores of its own: the job's processes inherit this affinity."""
    assert _POOL is not None, "called in a --jobs worker process only"
    cluster = planned.job.cluster
    with _POOL.lend(cluster.groups * cluster.workers_per_group) as cores:
        os.sched_setaffinity(0, cores)
        return run_planned(planned)


def run_grid(planned: list[Planned], jobs: int) -> list[RunResult]:
    """Run the grid one job at a time, or ``jobs`` at a time in worker processes on disjoint cores."""
    if jobs == 1:
        return [run_planned(p) for p in planned]
    context = multiprocessing.get_context("spawn")
    pool = CorePool(context)
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_join_pool, initargs=(pool,)) as workers:
        return list(workers.map(run_pinned, planned))


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    steps = QUICK_STEPS if args.quick else args.steps
    model = "tiny" if args.quick else args.model
    if steps < EVAL_EVERY or steps % EVAL_EVERY:
        sys.exit(f"--steps={steps}: must be a positive multiple of {EVAL_EVERY} (every H divides it)")
    began = time.monotonic()
    shared = shared_overrides(model, steps, args.device, args.quick)
    results, device = [], args.device
    if args.collect:
        results, model, steps, device = collect_kept(args.collect)
    with runs_root(args.keep_runs, EXPERIMENT) as root:
        if not args.collect:
            results = run_grid(plan(args, root, shared, model, steps), args.jobs)
    n_params = results[0].summary["parameters"] if results else 0
    seeds = sorted({r.seed for r in results})
    setup = (
        f"model={model} ({n_params / 1e6:.2f}M parameters), {steps} inner steps per group, "
        f"1 {device.upper()} process per group, trainer batch as conf/experiment/{EXPERIMENT}.yaml"
        f"{' with ' + ', '.join(QUICK_BATCH) if args.quick else ''}; equal tokens at each M; "
        f"trainer.seed {', '.join(map(str, seeds))}."
    )
    folder = Path(args.results) if args.results else RESULTS
    stem = f"compare_ddp_{model}_{steps}"
    drawn = plot(results, folder / f"{stem}.png", setup)
    drawn_bytes = plot_bytes(results, folder / f"{stem}_bytes.png", setup)
    text = "\n".join(
        [setup, "", table(results), "", seed_table(results), "", *targets(results), "", drawn, drawn_bytes]
    )
    print(text)
    print(f"table written to {write_result(f'{stem}.md', text, args.results)}", file=sys.stderr)
    curves = {f"{r.config.name} M={r.config.groups} seed {r.seed}": r.curve for r in results}
    write_result(f"{stem}.json", json.dumps(curves, indent=2), args.results)
    print(f"total wall time {(time.monotonic() - began) / 60:.1f} min", file=sys.stderr)
    failed = [f"{r.config.name} M={r.config.groups} seed {r.seed}" for r in results if not r.summary.get("ok")]
    if failed:  # the table shows them; the exit status must too
        sys.exit(f"{len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
