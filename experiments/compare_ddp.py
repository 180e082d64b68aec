"""Does DiLoCo train as well as data parallel? Every algorithm at equal tokens, side by side, one table.

``python experiments/compare_ddp.py [--model mini|midi] [--steps N] [--only NAME ...] [--quick]``
``python experiments/compare_ddp.py --collect DIR [DIR ...]``: one table from runs kept (``--keep-runs``)
by earlier invocations, e.g. a long grid split over several sessions.

Each configuration is a whole job (``conf/experiment/compare_ddp.yaml`` plus its overrides) run
through the launcher, one after the other on this machine: ``ddp`` (gradients all-reduced
every step: the quality DiLoCo aims for), ``local`` (groups that never communicate: the floor
DiLoCo must beat), DiLoCo at several H and M, with the mixing α ramped (the default), off,
from the first round and (at M=4) not scaled down by the number of groups, the paper's exact
settings, Streaming DiLoCo (P=4, τ=1, fp4; α on and off), and SparseLoCo's error-feedback top-k
(``algo.compress=topk``) at several densities and H. Every group reads its own shard
and takes the same inner steps, so at M groups every configuration sees the same tokens.

The table gives the final eval loss of the job's global model, its ratio to ddp with as many
groups, the gap closed, (local − x)/(local − ddp), and bytes sent per token; the PNG draws eval
loss against the job's tokens (group 0's model at each evaluation: with ``trainer.eval_every`` a
multiple of H it is evaluated right after a sync, so for DiLoCo it is the global model, or with
α > 0 the group's mix of it and its own weights; the final loss is always the global model's);
a second PNG draws every run's final eval loss against its bytes per token (log scale).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
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

from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl

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
    def family(self) -> str:
        """The plot's marker: the algorithm, or sparseloco for a compressed DiLoCo."""
        return "sparseloco" if "algo.compress=topk" in self.overrides else self.algo


def _diloco(h: int, groups: int = 2, *extra: str, name: str = "") -> Config:
    return Config(name or f"diloco H={h}", groups, ("algo=diloco", f"algo.sync_every={h}", *extra))


SPARSELOCO = {"algo.alpha": "0", "outer_opt": "sgd", "outer_opt.lr": "1", "outer_opt.momentum": "0"}
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
    Config("streaming H=100 P=4 τ=1 fp4", 2, STREAMING),
    Config("streaming H=100 P=4 τ=1 fp4, α=0", 2, (*STREAMING, "algo.alpha=0")),
    Config("streaming H=100 P=4 τ=1 fp32", 2, (*STREAMING, "algo.quantize=none")),
    Config("streaming H=100 P=4 τ=0 fp32, α=0", 2, (*STREAMING, "algo.quantize=none", "algo.delay=0", "algo.alpha=0")),
    Config("ddp", 4, ("algo=ddp",)),
    Config("local", 4, ("algo=local",)),
    _diloco(50, 4),
    _diloco(50, 4, "algo.alpha=0", name="diloco H=50, α=0"),
    _diloco(50, 4, "algo.alpha_reference_groups=0", name="diloco H=50, α=0.5 whatever M"),
    _diloco(50, 2, "algo.quantize=fp4", name="diloco H=50 fp4"),
    *(_sparse(h, d) for h in (20, 25, 50) for d in (0.01, 0.02, 0.03)),
    _sparse(50, 0.02, name=", α ramped", changes={"algo.alpha": None}),
    *(_sparse(20, d, name=", α ramped", changes={"algo.alpha": None}) for d in (0.01, 0.03)),
    _sparse(50, 0.02, name=", DiLoCo's outer step", changes=DILOCO_OUTER),
    _sparse(50, 0.02, name=", DiLoCo's outer step, β=0", changes=DILOCO_OUTER | {"algo.error_decay": "0"}),
    _sparse(50, 0.02, 4),
]
QUICK_STEPS = 100
QUICK_BATCH = ["trainer.batch_size=4", "trainer.seq_len=64"]  # a smoke run: start-up dominates anyway


@dataclass
class RunResult:
    """What the table and the plot need from one finished job's run directory."""

    config: Config
    summary: dict[str, Any]
    curve: list[tuple[float, float]]  # (job tokens, eval loss of group 0's model)

    @property
    def loss(self) -> float:
        return self.summary["final_eval_loss"] if self.summary.get("ok") else float("nan")


def collect(config: Config, run_dir: Path) -> RunResult:
    """Read a finished job's summary.json and group 0's evaluations."""
    paths = RunPaths(run_dir)
    summary = json.loads(paths.summary.read_text())
    tokens_per_step = summary["tokens_seen"] / max(summary["steps"], 1)  # the whole job's, every group
    curve = [(r["step"] * tokens_per_step, r["eval/loss"]) for r in read_jsonl(paths.metrics(0)) if "eval/loss" in r]
    curve.append((summary["tokens_seen"], summary["final_eval_loss"]))
    return RunResult(config, summary, sorted(dict(curve).items()))


def collect_kept(roots: list[Path]) -> tuple[list[RunResult], str, int]:
    """Every finished run under ``roots`` that names its row (``CONFIG_FILE``), in the table's
    order, and the model and steps they share (runs of another model or length are refused)."""
    order = {(c.name, c.groups): i for i, c in enumerate(CONFIGS)}
    found, shapes = [], set()
    for marker in sorted(m for root in roots for m in root.glob(f"**/{CONFIG_FILE}")):
        if RunPaths(marker.parent).summary.exists():
            saved = json.loads(marker.read_text())
            config = Config(saved["name"], saved["groups"], tuple(saved["overrides"]))
            found.append(collect(config, marker.parent))
            shapes.add((saved["model"], saved["steps"]))
    if len(shapes) != 1:
        sys.exit(f"--collect: need finished runs of one model and length under {roots}, found {sorted(shapes)}")
    model, steps = shapes.pop()
    return sorted(found, key=lambda r: order.get((r.config.name, r.config.groups), len(order))), model, steps


def baseline(results: list[RunResult], algo: str, groups: int) -> float | None:
    """The loss of the ``algo`` run with ``groups`` groups; None if there is none or it failed."""
    found = [r.loss for r in results if r.config.algo == algo and r.config.groups == groups]
    return found[0] if found and math.isfinite(found[0]) else None


def rows(results: list[RunResult]) -> list[list[str]]:
    """One row per run: loss, ratio to ddp and gap closed (both against the baselines with as many groups)."""
    out = []
    for r in results:
        ddp, local = baseline(results, "ddp", r.config.groups), baseline(results, "local", r.config.groups)
        known = math.isfinite(r.loss)
        ratio = f"{100 * (r.loss / ddp - 1):+.1f}%" if known and ddp else "–"
        closed = f"{100 * (local - r.loss) / (local - ddp):.0f}%" if known and ddp and local and local != ddp else "–"
        outcome = "" if r.summary.get("ok") else f" (failed: {r.summary.get('failure')})"
        out.append(
            [
                r.config.name + outcome,
                str(r.config.groups),
                f"{r.loss:.4f}",
                ratio,
                closed,
                f"{r.summary['bytes_per_token']:.1f}",
                f"{r.summary['wall_seconds'] / 60:.1f}",
            ]
        )
    return out


def table(results: list[RunResult]) -> str:
    headers = ["config", "M", "final eval loss", "vs ddp", "gap closed", "bytes/token", "wall min"]
    return markdown_table(headers, rows(results))


def targets(results: list[RunResult]) -> list[str]:
    """The recipe's targets that this table decides: gap closed at H=50, never worse than local, streaming ≈ DiLoCo."""
    lines = []
    local2, ddp2 = baseline(results, "local", 2), baseline(results, "ddp", 2)
    default = next((r for r in results if r.config == _diloco(50)), None)
    if default and local2 and ddp2:
        closed = (local2 - default.loss) / (local2 - ddp2)
        lines.append(f"- gap closed by DiLoCo M=2 H=50 with the defaults: {100 * closed:.0f}%")
    if local2:
        worse = [
            r.config.name for r in results if r.config.family == "diloco" and r.config.groups == 2 and r.loss > local2
        ]
        lines.append(f"- DiLoCo worse than local: {', '.join(worse) if worse else 'none'}")
    stream = next((r for r in results if r.config.name == "streaming H=100 P=4 τ=1 fp4"), None)
    same_h = next((r for r in results if r.config == _diloco(100)), None)
    if stream and same_h:
        lines.append(f"- streaming vs DiLoCo at H=100: {100 * (stream.loss / same_h.loss - 1):+.2f}%")
    lines += [_sparse_target(results, groups) for groups in (2, 4)]
    return [line for line in lines if line]


def _sparse_target(results: list[RunResult], groups: int) -> str:
    """Issue 38's target: the sparse row with the lowest loss among those sending >= 3,000x fewer bytes
    per token than ddp, against DiLoCo H=50 with the defaults, at M groups ("" without those runs)."""
    ddp = next((r for r in results if r.config.algo == "ddp" and r.config.groups == groups), None)
    default = next((r for r in results if r.config == _diloco(50, groups)), None)
    sparse = [r for r in results if r.config.family == "sparseloco" and r.config.groups == groups]
    if not (ddp and default and sparse):
        return ""
    ratio = {r.config.name: ddp.summary["bytes_per_token"] / r.summary["bytes_per_token"] for r in sparse}
    frugal = [r for r in sparse if ratio[r.config.name] >= 3000 and math.isfinite(r.loss)]
    if not frugal:
        return f"- M={groups}: no sparse row sends 3,000x fewer bytes per token than ddp"
    best = min(frugal, key=lambda r: r.loss)
    return (
        f"- M={groups}: {best.config.name} sends {ratio[best.config.name]:,.0f}x fewer bytes per token than ddp, "
        f"loss {100 * (best.loss / default.loss - 1):+.2f}% against DiLoCo H=50"
    )


def plot(results: list[RunResult], path: Path, title: str) -> str:
    """Eval loss against the job's tokens, one panel per M."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    group_counts = sorted({r.config.groups for r in results})
    fig, axes = plt.subplots(1, len(group_counts), figsize=(6.5 * len(group_counts), 4.8), squeeze=False)
    for ax, groups in zip(axes[0], group_counts):
        for r in (r for r in results if r.config.groups == groups):
            tokens, losses = zip(*r.curve)
            style = {"ls": "--", "color": "black"} if r.config.algo in ("ddp", "local") else {}
            if r.config.algo == "local":
                style["color"] = "grey"
            ax.plot([t / 1e6 for t in tokens], losses, lw=1.3, label=r.config.name, **style)
        losses = sorted(v for r in results if r.config.groups == groups for _, v in r.curve)
        if losses:
            ax.set_ylim(0.97 * losses[0], losses[int(0.9 * (len(losses) - 1))])
        ax.set_title(f"M={groups} groups", loc="left")
        ax.set_xlabel("tokens (millions, all groups)")
        ax.set_ylabel("eval loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 60 * len(group_counts)), fontsize=9)
    return save_figure(fig, path)


def plot_bytes(results: list[RunResult], path: Path, title: str) -> str:
    """Final eval loss against bytes sent per token (log scale), one panel per M; local (no bytes) is a line."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    group_counts = sorted({r.config.groups for r in results})
    fig, axes = plt.subplots(1, len(group_counts), figsize=(6.5 * len(group_counts), 4.8), squeeze=False)
    for ax, groups in zip(axes[0], group_counts):
        for r in (r for r in results if r.config.groups == groups and math.isfinite(r.loss)):
            if r.summary["bytes_per_token"] > 0:
                ax.scatter(r.summary["bytes_per_token"], r.loss, s=18, marker=_MARKERS.get(r.config.family, "o"))
                ax.annotate(r.config.name, (r.summary["bytes_per_token"], r.loss), fontsize=6, alpha=0.8)
            else:
                ax.axhline(r.loss, ls="--", color="grey", lw=1, label=r.config.name)
        ax.set_xscale("log")
        ax.set_title(f"M={groups} groups", loc="left")
        ax.set_xlabel("bytes sent per token (log)")
        ax.set_ylabel("final eval loss (nats/byte)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 60 * len(group_counts)), fontsize=9)
    return save_figure(fig, path)


_MARKERS = {"ddp": "s", "diloco": "o", "streaming": "^", "sparseloco": "*"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mini", help="conf/model preset (mini: 0.8M, midi: 4.6M parameters)")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps of every job, a multiple of 100")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run only these configurations (names as in the table)"
    )
    parser.add_argument("--groups", type=int, nargs="+", metavar="M", help="run only the configurations with M groups")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny model, {QUICK_STEPS} steps of 4 x 64 tokens, ddp/local/diloco M=2: a smoke test",
    )
    parser.add_argument(
        "--collect", nargs="+", metavar="DIR", type=Path, help="run nothing: one table from runs kept under DIR"
    )
    add_output_arguments(parser)
    return parser.parse_args(argv)


def chosen(args: argparse.Namespace) -> list[Config]:
    if args.quick:
        return [c for c in CONFIGS if c.groups == 2 and c.name in ("ddp", "local", "diloco H=50")]
    unknown = set(args.only or []) - {c.name for c in CONFIGS}
    if unknown:
        sys.exit(f"--only: unknown configuration(s) {sorted(unknown)}; known: {sorted({c.name for c in CONFIGS})}")
    return [
        c for c in CONFIGS if (not args.only or c.name in args.only) and (not args.groups or c.groups in args.groups)
    ]


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    steps = QUICK_STEPS if args.quick else args.steps
    model = "tiny" if args.quick else args.model
    if steps < EVAL_EVERY or steps % EVAL_EVERY:
        sys.exit(f"--steps={steps}: must be a positive multiple of {EVAL_EVERY} (every H divides it)")
    began = time.monotonic()
    shared = [f"model={model}", f"trainer.max_steps={steps}", f"trainer.eval_every={EVAL_EVERY}"]
    shared += QUICK_BATCH if args.quick else []
    results = []
    if args.collect:
        results, model, steps = collect_kept(args.collect)
    with runs_root(args.keep_runs, EXPERIMENT) as root:
        for i, config in enumerate([] if args.collect else chosen(args)):
            job = compose_job([*shared, f"cluster.groups={config.groups}", *config.overrides], EXPERIMENT)
            run_dir = root / f"run{i}"
            started = time.monotonic()
            run_job(job, run_dir, keep_failure=True)
            row = dataclasses.asdict(config) | {"model": model, "steps": steps}
            (run_dir / CONFIG_FILE).write_text(json.dumps(row))
            results.append(collect(config, run_dir))
            print(
                f"{config.name} M={config.groups}: eval {results[-1].loss:.4f} "
                f"in {(time.monotonic() - started) / 60:.1f} min",
                file=sys.stderr,
                flush=True,
            )
    n_params = results[0].summary["parameters"] if results else 0
    setup = (
        f"model={model} ({n_params / 1e6:.2f}M parameters), {steps} inner steps per group, "
        f"1 CPU process per group, trainer batch as conf/experiment/{EXPERIMENT}.yaml"
        f"{' with ' + ', '.join(QUICK_BATCH) if args.quick else ''}; equal tokens at each M."
    )
    folder = Path(args.results) if args.results else RESULTS
    stem = f"compare_ddp_{model}_{steps}"
    drawn = plot(results, folder / f"{stem}.png", setup)
    drawn_bytes = plot_bytes(results, folder / f"{stem}_bytes.png", setup)
    text = "\n".join([setup, "", table(results), "", *targets(results), "", drawn, drawn_bytes])
    print(text)
    print(f"table written to {write_result(f'{stem}.md', text, args.results)}", file=sys.stderr)
    curves = {f"{r.config.name} M={r.config.groups}": r.curve for r in results}
    write_result(f"{stem}.json", json.dumps(curves, indent=2), args.results)
    print(f"total wall time {(time.monotonic() - began) / 60:.1f} min", file=sys.stderr)
    failed = [f"{r.config.name} M={r.config.groups}" for r in results if not r.summary.get("ok")]
    if failed:  # the table shows them; the exit status must too
        sys.exit(f"{len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
