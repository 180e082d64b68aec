"""Soak: one Streaming DiLoCo run through >= 1,200 SIGKILL recoveries and other faults, then the same job fault-free.

Four replica groups of one CPU process each train the tiny model with Streaming DiLoCo (H=20,
P=2, τ=1, fp4; ``conf/experiment/soak.yaml``). The same job runs twice, one after the other:

- ``faults=soak``: a random group is SIGKILLed every 1.5 s (never the same group twice in a
  row, a group holding the job's state first, never leaving fewer than two other groups
  holding it), a group is
  SIGSTOPped for 4 s every 45 s, a NaN update is injected every 30 s and the lighthouse is
  killed for 2 s every 90 s, until the first group leaves the job (``conf/faults/soak.yaml``).
  There are no checkpoints: every restarted group heals from a live peer.
- ``faults=none``: the same ``trainer.max_steps``, nothing injected.

``trainer.max_steps`` comes from a short fault-free calibration: enough steps that the
faulty run lasts for 1,200 kills and a margin even if the faults cost it nothing. Everything
reported is read back from the run directories: ``summary.json``, ``events.jsonl`` and every
group's commit log (the records of all its processes in turn), where every round committed
by more than one group must carry one digest.

    python -m experiments.fault_tolerance.soak            # ~65 min on two cores (a calibration, ~35 min faulty, ~31 fault-free)
    python -m experiments.fault_tolerance.soak --quick    # 3 groups, a kill every 3 s, 2 x ~20 s: a smoke test

Prints the plan and progress (kills so far, every minute) to stderr, a markdown table and the
target checks to stdout and experiments/results/soak.md (the numbers also to soak.json), and
plots loss against wall time with the faults marked to experiments/results/soak.png when
matplotlib is installed (``pip install -e .[experiments]``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from experiments.common import (
    NO_MATPLOTLIB,
    RESULTS,
    add_output_arguments,
    add_steps_argument,
    check_steps,
    compose_job,
    markdown_table,
    pyplot,
    runs_root,
    save_figure,
    stop_on_sigterm,
    verdict,
    write_result,
)
from experiments.fault_tolerance.kill_every import LOSS_TOLERANCE, Run, calibrate, curves, mean_curve, run_one

EXPERIMENT = "soak"
FAULTY = "faulty"
FAULT_FREE = "fault-free"
TARGET_RECOVERIES = 1200
# A kill hits a restarted group before its first heal when no holder of the state may die
# (faults.kill_target), and such a restart never counts as a recovery: plan more kills than that.
KILL_MARGIN = 1.15
# The faulty run's pace against the fault-free one (a healed group jumps to its peers' step,
# so the job's furthest step slows only a little): 0.91 over the first 4 min of a full run.
FAULTY_PACE = 0.9
PROGRESS_EVERY_S = 60.0
EVAL_POINTS = 10  # evaluations on the way, for the plot
SHOWN = (("kill", "SIGKILL"), ("hang", "SIGSTOP"), ("nan", "NaN update"), ("lighthouse_down", "lighthouse kill"))


@dataclass
class Settings:
    quick: bool
    kill_every: float
    start_after: float
    min_alive: int
    seconds: float  # wall time of the faulty run planned (the fault-free one takes FAULTY_PACE of it)
    calibration_s: float
    bin_s: float  # the plot's time bins for the mean over groups
    hist_s: float  # the plot's time bins for kills and recoveries
    extra: list[str]  # overrides of both runs and of the calibration
    faults: list[str]  # overrides of the faulty run


def settings(args: argparse.Namespace) -> Settings:
    preset = compose_job(["faults=soak"], EXPERIMENT).faults
    if args.quick:
        # 3 groups (min_alive 2: a kill only when both others hold the state), faults from 5 s,
        # 12 s per run, every fault kind at least once; a group left behind at the end is
        # stopped after 12 s.
        kill_every, start_after = args.kill_every or 3.0, 5.0
        faults = [f"faults.kill_every={kill_every}", f"faults.start_after={start_after}", "faults.hang_every=8"]
        faults += ["faults.nan_every=7", "faults.restart_lighthouse_every=10"]
        extra = ["cluster.groups=3", "cluster.timeouts.quorum=12"]
        return Settings(True, kill_every, start_after, preset.min_alive, 12.0, 6.0, 2.0, 10.0, extra, faults)
    kill_every = args.kill_every or preset.kill_every
    seconds = preset.start_after + TARGET_RECOVERIES * KILL_MARGIN * kill_every
    faults = [f"faults.kill_every={kill_every}"] if args.kill_every else []
    return Settings(False, kill_every, preset.start_after, preset.min_alive, seconds, 20.0, 30.0, 60.0, [], faults)


def plan_steps(rate: float, seconds: float, h: int) -> int:
    """Steps for a faulty run of ``seconds`` at fault-free ``rate`` steps/s, a multiple of H (the
    last round reaches θ_g). No margin on top: KILL_MARGIN is one, and the fault-free run follows.
    """
    return max(2 * h, math.ceil(rate * FAULTY_PACE * seconds / h) * h)


def digest_mismatches(commits: dict[int, list[dict[str, Any]]]) -> tuple[list[int], int]:
    """Rounds whose committed records (every process of every group) carry more than one digest,
    and how many rounds were committed by two groups or more (the rounds the check can catch)."""
    digests: dict[int, set[str | None]] = defaultdict(set)
    groups: dict[int, set[int]] = defaultdict(set)
    for group, records in commits.items():
        for record in records:
            if record.get("committed"):
                digests[record["round"]].add(record.get("digest"))
                groups[record["round"]].add(group)
    mismatched = sorted(r for r, found in digests.items() if len(found) > 1)
    return mismatched, sum(len(g) > 1 for g in groups.values())


def numbers(run: Run, base: Run) -> dict[str, Any]:
    """Every figure of the table for one run (also written as JSON)."""
    s = run.summary
    mismatched, checked = digest_mismatches(run.commits)
    base_goodput = base.summary["goodput_tokens_per_s"]
    return {
        "ok": s["ok"],
        "failure": s["failure"],
        "wall_seconds": s["wall_seconds"],
        "steps": s["steps"],
        "kills": run.count("kill"),
        "restarts": run.count("restart"),
        "recoveries": run.healed_restarts(),
        "hangs": run.count("hang"),
        "nan_updates": run.count("nan"),
        "lighthouse_kills": run.count("lighthouse_down"),
        "lighthouse_restarts": s["lighthouse_restarts"],  # unplanned deaths, restarted by the supervisor
        "crashes": run.count("crash"),
        "skipped_faults": run.count("skipped"),
        "syncs_committed": s["syncs_committed"],
        "syncs_attempted": s["syncs_attempted"],
        "digest_mismatches": len(mismatched),
        "mismatched_rounds": mismatched[:20],
        "rounds_checked": checked,
        "final_eval_loss": s["final_eval_loss"],
        "goodput_tokens_per_s": s["goodput_tokens_per_s"],
        "goodput_ratio": s["goodput_tokens_per_s"] / base_goodput if base_goodput else math.nan,
        "time_to_heal_s": s["time_to_heal_s"],
    }


def _outcome(n: dict[str, Any]) -> str:
    return "ok" if n["ok"] else f"failure: {n['failure']}"


def _loss(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.3g}"  # a diverged model's loss in a readable width


def _heal(n: dict[str, Any]) -> str:
    stats = n["time_to_heal_s"]
    return f"{stats['median']:.2f} / {stats['max']:.2f}" if stats.get("count") else "n/a"


ROWS = [
    ("outcome", _outcome),
    ("wall time", lambda n: f"{n['wall_seconds'] / 60:.1f} min ({n['wall_seconds']:.0f} s)"),
    ("inner steps per group", lambda n: str(n["steps"])),
    ("kills (SIGKILL)", lambda n: str(n["kills"])),
    ("recoveries (restarted processes healed from a peer)", lambda n: f"{n['recoveries']} of {n['restarts']}"),
    ("hangs (SIGSTOP)", lambda n: str(n["hangs"])),
    ("NaN updates", lambda n: str(n["nan_updates"])),
    ("lighthouse kills", lambda n: str(n["lighthouse_kills"])),
    ("faults skipped (no group could take them)", lambda n: str(n["skipped_faults"])),
    ("crashes (unplanned)", lambda n: str(n["crashes"])),
    ("committed / attempted syncs", lambda n: f"{n['syncs_committed']} / {n['syncs_attempted']}"),
    (
        "digest mismatches (rounds committed by 2+ groups)",
        lambda n: f"{n['digest_mismatches']} (of {n['rounds_checked']})",
    ),
    ("time to heal s (median / max)", _heal),
    ("final eval loss", lambda n: _loss(n["final_eval_loss"])),
    ("goodput (committed tokens/s)", lambda n: f"{n['goodput_tokens_per_s']:,.0f}"),
    ("goodput ratio faulty / fault-free", lambda n: f"{n['goodput_ratio']:.3f}"),
]


def table(figures: dict[str, dict[str, Any]]) -> str:
    return markdown_table(["", *figures], [[label, *(cell(n) for n in figures.values())] for label, cell in ROWS])


def targets(figures: dict[str, dict[str, Any]], quick: bool) -> list[str]:
    faulty, clean = figures[FAULTY], figures[FAULT_FREE]
    healed = faulty["recoveries"]
    expected = " (--quick: not expected)" if quick else ""
    loss, base = faulty["final_eval_loss"], clean["final_eval_loss"]
    gap = (loss - base) / base if base else math.nan
    gap_text = f", {gap:+.2%}" if abs(gap) < 100 else ""  # not a 30-digit percentage when a run diverged
    mismatches = {name: n["digest_mismatches"] for name, n in figures.items()}
    checked = ", ".join(f"{name} {m} of {figures[name]['rounds_checked']}" for name, m in mismatches.items())
    return [
        f">= {TARGET_RECOVERIES} recoveries: {verdict(healed >= TARGET_RECOVERIES)} "
        f"({healed} healed restarts for {faulty['kills']} kills){expected}",
        f"0 digest mismatches after every committed round: {verdict(not any(mismatches.values()))} "
        f"({checked} rounds committed by 2+ groups)",
        f"final eval loss within {LOSS_TOLERANCE:.0%} of fault-free: {verdict(abs(gap) <= LOSS_TOLERANCE)} "
        f"({_loss(loss)} vs {_loss(base)}{gap_text})",
        f"both runs ok: {verdict(faulty['ok'] and clean['ok'])} "
        f"({'; '.join(f'{name} {_outcome(n)}' for name, n in figures.items())})",
    ]


class Progress:
    """Every ``every_s``, one stderr line on a running job: elapsed, faults so far, furthest step."""

    def __init__(self, name: str, run_dir: Path, steps: int, every_s: float = PROGRESS_EVERY_S) -> None:
        self.name = name
        self.run_dir = run_dir
        self.steps = steps
        self.every_s = every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Progress:
        self.start = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()

    def _loop(self) -> None:
        while not self.stopped.wait(self.every_s):
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        events = read_jsonl(RunPaths(self.run_dir).events)
        counts = {kind: sum(e["kind"] == kind for e in events) for kind, _ in SHOWN}
        faults = ", ".join(f"{counts[kind]} {label}" for kind, label in SHOWN)
        step = max(
            (r.get("step", 0) for p in RunPaths(self.run_dir).all_metrics() for r in read_jsonl(p)[-5:]),
            default=0,
        )
        elapsed = (time.monotonic() - self.start) / 60
        return f"[{self.name} {elapsed:.1f} min] {faults}; furthest step {step}/{self.steps}"


def plot(runs: dict[str, Run], path: Path, bin_s: float, hist_s: float) -> str:
    """Loss against wall time for both runs, the faulty run's faults as a strip per kind and kills per minute."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    faulty = runs[FAULTY]
    fig, (ax, strip, hist) = plt.subplots(
        3, 1, figsize=(13, 8.5), sharex=True, gridspec_kw={"height_ratios": [3.2, 1.1, 1.3]}
    )
    for run, style in ((runs[FAULT_FREE], {"color": "grey", "ls": "--"}), (faulty, {"color": "black"})):
        times, values = mean_curve(curves(run, "train/loss"), bin_s)
        ax.plot([t / 60 for t in times], values, lw=1.3, label=f"{run.name}: train loss, mean over groups", **style)
        evals = [(t / 60, v) for ts, vs in curves(run, "eval/loss").values() for t, v in zip(ts, vs)]
        if evals:
            ax.scatter(*zip(*evals), s=12, color=style["color"], marker="o", zorder=3, label=f"{run.name}: eval loss")
    values = sorted(v for run in runs.values() for _, vs in curves(run, "train/loss").values() for v in vs)
    if values:  # the first steps' loss (ln 256 = 5.5) would flatten everything after: clip the top 2%
        ax.set_ylim(0.97 * values[0], values[int(0.98 * (len(values) - 1))])
        if values[-1] > 100 * values[0] > 0:
            ax.set_yscale("log")  # a diverged run: keep the fault-free curve visible
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(
        f"Streaming DiLoCo soak: {faulty.count('kill')} kills, {faulty.healed_restarts()} recoveries", loc="left"
    )
    for row, (kind, _) in enumerate(SHOWN):
        times = [(e["time"] - faulty.start) / 60 for e in faulty.events if e["kind"] == kind]
        strip.eventplot([times], lineoffsets=row, linelengths=0.8, linewidths=0.5, colors=f"C{row + 3}")
    strip.set_yticks(range(len(SHOWN)), [f"{label} ({faulty.count(kind)})" for kind, label in SHOWN], fontsize=8)
    strip.set_ylim(-0.6, len(SHOWN) - 0.4)
    strip.set_title("faults of the faulty run (one tick each)", loc="left", fontsize=9)
    kills = [(e["time"] - faulty.start) / 60 for e in faulty.events if e["kind"] == "kill"]
    healed = [(t - faulty.start) / 60 for g, t in faulty.restarts() if faulty.healed_at(g, t) is not None]
    width = hist_s / 60
    edges = [i * width for i in range(math.ceil(max([faulty.summary["wall_seconds"] / 60, *kills]) / width) + 1)]
    hist.hist([kills, healed], bins=edges, label=["kills", "recoveries (by restart time)"], color=["C3", "C2"])
    hist.set_ylabel(f"per {hist_s:g} s")
    hist.legend(loc="upper right", fontsize=8)
    hist.set_xlabel("minutes since launch")
    return save_figure(fig, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 groups, a kill every 3 s, ~20 s per run: a smoke test")
    parser.add_argument(
        "--kill-every", type=float, help="seconds between kills (default faults/soak.yaml's; --quick: 3)"
    )
    add_steps_argument(parser)
    add_output_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    cfg = settings(args)
    began = time.monotonic()
    h = compose_job(cfg.extra, EXPERIMENT).algo.sync_every
    check_steps(args.steps, h)
    with runs_root(args.keep_runs, EXPERIMENT) as root:
        steps, how = args.steps, "--steps"
        if steps is None:
            rate = calibrate(root, cfg.calibration_s, EXPERIMENT, tuple(cfg.extra))
            steps, how = plan_steps(rate, cfg.seconds, h), f"calibrated at {rate:.1f} steps/s"
            minutes = steps / rate / 60  # the fault-free run's
            faulty = minutes / FAULTY_PACE
            kills = (faulty * 60 - cfg.start_after) / cfg.kill_every
            print(
                f"plan: {rate:.1f} steps/s (fault-free, every group running) -> trainer.max_steps={steps}: "
                f"~{faulty:.0f} min faulty (~{kills:.0f} kills at one per {cfg.kill_every:g} s), then "
                f"~{minutes:.0f} min fault-free; ~{faulty + minutes + (time.monotonic() - began) / 60:.0f} min in all",
                file=sys.stderr,
                flush=True,
            )
        shared = [
            f"trainer.max_steps={steps}",
            f"trainer.eval_every={max(h, round(steps / EVAL_POINTS / h) * h)}",
            "trainer.eval_batches=8",
            *cfg.extra,
        ]
        runs = {}
        for name, overrides in ((FAULTY, ["faults=soak", *cfg.faults]), (FAULT_FREE, ["faults=none"])):
            started = time.monotonic()
            with Progress(name, root / name, steps):
                runs[name] = run_one(name, overrides + shared, root / name, EXPERIMENT, keep_failure=True)
            print(f"{name} run done in {(time.monotonic() - started) / 60:.1f} min", file=sys.stderr, flush=True)
        figures = {name: numbers(run, runs[FAULT_FREE]) for name, run in runs.items()}
        job = compose_job(shared, EXPERIMENT)
        setup = (
            f"Streaming DiLoCo H={h}, P={job.algo.fragments}, τ={job.algo.delay}, {job.algo.quantize}; "
            f"{job.cluster.groups} groups x 1 CPU process, {runs[FAULT_FREE].summary['parameters'] / 1e6:.2f}M "
            f"parameters, {steps} inner steps per run ({how}). Faulty run: {' '.join(['faults=soak', *cfg.faults])} "
            f"(SIGKILL of a random group every {cfg.kill_every:g} s, never leaving fewer than "
            f"{cfg.min_alive} other groups holding the state; SIGSTOP "
            "hangs, NaN updates, lighthouse kills), until the first group left the job."
        )
        folder = Path(args.results) if args.results else RESULTS
        drawn = plot(runs, folder / "soak.png", cfg.bin_s, cfg.hist_s)
        text = "\n".join([setup, "", table(figures), "", *targets(figures, cfg.quick), "", drawn])
        print(text)
        print(f"table written to {write_result('soak.md', text, args.results)}", file=sys.stderr)
        write_result("soak.json", json.dumps(figures, indent=2), args.results)
    print(f"total wall time {(time.monotonic() - began) / 60:.1f} min", file=sys.stderr)
    failed = [f"{name}: {n['failure']}" for name, n in figures.items() if not n["ok"]]
    if failed:  # the table shows them; the exit status must too
        sys.exit(f"run(s) failed: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
