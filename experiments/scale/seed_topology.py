"""The seed's shape at CPU scale: 30 Streaming DiLoCo groups, a group SIGKILLed every 15 s or 60 s.

Thirty replica groups of one CPU process each train the tiny model with Streaming DiLoCo (H=20,
P=2, τ=1, fp4; ``conf/experiment/seed_topology.yaml``), forked from the launcher's fork server.
The same job (the same ``trainer.max_steps``, from a short fault-free calibration) runs in turn:

- ``faults=none``: nothing injected, the reference;
- ``faults=seed_topology_60s``: a random group SIGKILLed every 60 s, one SIGSTOPped for 10 s
  every 150 s; every restarted group heals from a live peer (no checkpoints);
- ``faults=seed_topology_15s``: the same with a kill every 15 s;
- ``algo=ddp``, fault-free: data parallel on the same groups and tokens (gradients averaged
  across the groups every inner step), so the table also says how well the job trained: each
  run's final eval loss against it.

Everything reported is read back from the run directories (``summary.json``, ``events.jsonl``,
every group's commit log) as ``kill_every.py`` and ``soak.py`` read them, plus the job's
peak memory sampled from /proc while it runs (``JobMemory``).

Efficiency, after the PyTorch blog "Fault Tolerant Llama: training with 2000 synthetic failures
every ~15 seconds and no checkpoints on Crusoe L40S" (torchft + torchtitan, 2025), which reports
82.3% step / 81.2% training efficiency at a failure every 60 s and 30.2% / 13.4% at every 15 s.
Its exact wording could not be retrieved here; the two figures are implemented as:

- step efficiency: the steps the faulty job takes over the steps the fault-free job takes in
  the same wall time. Both runs train the same ``trainer.max_steps``, so it is T_free / T_faulty,
  T the seconds from launch to the first group's last inner step (``Run.training_times()[0]``).
  A healed group jumps to its peers' step, so this is how fast the job's step counter moves.
- training efficiency: the share of the compute the job had that ended up in the final model.
  Compute had: every group for T_faulty seconds at the fault-free pace; compute kept: the tokens
  of committed rounds (commit records' ``tokens``: a group's work since its last sync of that
  fragment). Measured to the last logged step, it is goodput_faulty / goodput_free
  (``Run.goodput_to_last_step``), and it is <= step efficiency: a dead, hung or healing group's
  steps, and those of a failed round, are never committed.

    python -m experiments.scale.seed_topology             # ~45 min on two cores: calibration + 3 x ~13 min
    python -m experiments.scale.seed_topology --faults 15 # the fault-free run and the 15-s run only
    python -m experiments.scale.seed_topology --quick     # 8 groups, a kill every 8 s, 3 x ~30 s: a smoke test

Prints the plan and progress to stderr, a markdown table to stdout and
experiments/results/seed_topology.md (the numbers also to seed_topology.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from diloco.config.job import JobConfig
from diloco.launch.summary import survivor_stalls
from experiments.common import (
    add_output_arguments,
    add_steps_argument,
    check_steps,
    compose_job,
    markdown_table,
    median,
    runs_root,
    stop_on_sigterm,
    write_result,
)
from experiments.fault_tolerance.kill_every import LOSS_TOLERANCE, Run, planned_steps, run_one
from experiments.fault_tolerance.soak import Progress, digest_mismatches

EXPERIMENT = "seed_topology"
FAULT_FREE = "fault-free"
DATA_PARALLEL = "data parallel"
# The preset's H and sync warm-up are Streaming's: data parallel syncs every step and reads neither.
DATA_PARALLEL_OVERRIDES = ["algo=ddp", "algo.sync_every=1", "~algo.sync_warmup_steps", "faults=none"]
BLOG = {60.0: (0.823, 0.812), 15.0: (0.302, 0.134)}  # kill period s -> the blog's (step, training) efficiency
MEMORY_EVERY_S = 2.0
EVAL_BATCHES = 8


@dataclass
class Settings:
    minutes: float  # least wall time of the fault-free run (the faulty ones take longer)
    kill_periods: list[float]
    calibration_s: float
    extra: list[str]  # overrides of every run and of the calibration
    faults: list[str]  # overrides of the faulty runs, after faults=seed_topology_*


def settings(args: argparse.Namespace) -> Settings:
    periods = [float(p) for p in args.faults.split(",")] if args.faults else None
    if args.quick:
        # 8 groups, faults from 6 s: a kill every 8 s and one 4-s hang in ~25 s of
        # training; a group left behind at the end is stopped after 12 s, not timeouts.quorum's 60.
        extra = ["cluster.groups=8", "cluster.timeouts.quorum=12"]
        faults = [
            "faults.start_after=6",
            f"faults.hang_every={30 if args.hang_every is None else args.hang_every}",
            "faults.hang_seconds=4",
        ]
        return Settings(args.minutes or 0.4, periods or [8.0], 8.0, extra, faults)
    faults = [] if args.hang_every is None else [f"faults.hang_every={args.hang_every}"]
    return Settings(args.minutes or 11.0, periods or [60.0, 15.0], 20.0, [], faults)


def faulty_overrides(period: float) -> list[str]:
    """The preset nearest the kill period (15 s or 60 s), with the period itself on top."""
    preset = "seed_topology_60s" if period >= 60 else "seed_topology_15s"
    return [f"faults={preset}", f"faults.kill_every={period:g}"]


def run_name(period: float) -> str:
    return f"kill every {period:g} s"


class JobMemory:
    """Peak memory of the job while it runs: every ``every_s``, the sum over this process (the
    supervisor) and all its descendants (fork server, lighthouse, workers) of RSS and of PSS from
    /proc/PID/smaps_rollup. RSS counts the pages forked workers share with the fork server once
    per process; PSS splits them, so the PSS sum is what the job really holds."""

    def __init__(self, every_s: float = MEMORY_EVERY_S) -> None:
        self.every_s = every_s
        self.peak_rss = self.peak_pss = self.peak_processes = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()

    def _loop(self) -> None:
        while not self.stopped.wait(self.every_s):
            pids = [os.getpid(), *descendants(os.getpid())]
            totals = [rss_pss_kb(pid) for pid in pids]
            self.peak_rss = max(self.peak_rss, sum(t[0] for t in totals))
            self.peak_pss = max(self.peak_pss, sum(t[1] for t in totals))
            self.peak_processes = max(self.peak_processes, sum(t != (0, 0) for t in totals))

    def figures(self) -> dict[str, float]:
        return {"rss_mib": self.peak_rss / 1024, "pss_mib": self.peak_pss / 1024, "processes": self.peak_processes}


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # gone since listdir
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the comm, which may hold spaces
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def rss_pss_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB; (0, 0) once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in lines[1:] if line.endswith("kB")}
    return fields.get("Rss", 0), fields.get("Pss", 0)


def spread(values: list[float]) -> dict[str, float]:
    """count, median, p90 and max of ``values`` (count 0 when there are none)."""
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"count": len(values), "median": median(values), "p90": p90, "max": ordered[-1]}


def numbers(run: Run, base: Run, memory: dict[str, float], ddp_loss: float | None = None) -> dict[str, Any]:
    """Every figure of the table for one run (also written as JSON); ``ddp_loss``: the data-parallel
    run's final eval loss (None while it has not run or failed)."""
    s = run.summary
    mismatched, checked = digest_mismatches(run.commits)
    hangs = [e for e in run.events if e["kind"] == "hang"]
    loss, base_loss = s["final_eval_loss"], base.summary["final_eval_loss"]
    return {
        "ok": s["ok"],
        "failure": s["failure"],
        "groups": s["groups"],
        "wall_seconds": s["wall_seconds"],
        "steps": s["steps"],
        "kills": run.count("kill"),
        "restarts": run.count("restart"),
        "recoveries": run.healed_restarts(),
        "hangs": run.count("hang"),
        "syncs_committed": s["syncs_committed"],
        "syncs_attempted": s["syncs_attempted"],
        "digest_mismatches": len(mismatched),
        "rounds_checked": checked,
        "goodput_ratio": s["goodput_tokens_per_s"] / base.summary["goodput_tokens_per_s"],
        "death_to_first_commit_s": s["death_to_first_commit_s"],
        "hang_stall_s": spread(survivor_stalls(hangs, run.commits)),
        "survivor_stall_s": s["survivor_stall_s"],
        "memory": memory,
        "final_eval_loss": loss,
        "loss_gap": (loss - base_loss) / base_loss if base_loss else math.nan,
        "vs_data_parallel": loss / ddp_loss - 1 if ddp_loss else math.nan,
        # A failed run's last step is not the planned one: no efficiency to speak of.
        "step_efficiency": base.training_times()[0] / run.training_times()[0] if s["ok"] else math.nan,
        "training_efficiency": run.goodput_to_last_step() / base.goodput_to_last_step() if s["ok"] else math.nan,
    }


def _stats(stats: dict[str, float], keys: tuple[str, ...]) -> str:
    if not stats.get("count"):
        return "n/a"
    return " / ".join(f"{stats[k]:.2f}" for k in keys) + f" (n={stats['count']})"


def _vs(ratio: float) -> str:
    return "n/a" if math.isnan(ratio) else f"{ratio:+.2%}"


def _blog(period: float | None) -> str:
    found = BLOG.get(period) if period is not None else None
    return f"{found[0]:.1%} / {found[1]:.1%}" if found else "n/a"


ROWS = [
    ("outcome", lambda n: "ok" if n["ok"] else f"failure: {n['failure']}"),
    ("groups x workers", lambda n: f"{n['groups']} x 1"),
    ("wall time s", lambda n: f"{n['wall_seconds']:.0f}"),
    ("inner steps per group", lambda n: str(n["steps"])),
    ("kills (SIGKILL)", lambda n: str(n["kills"])),
    ("recoveries (restarted processes healed from a peer)", lambda n: f"{n['recoveries']} of {n['restarts']}"),
    ("hangs (SIGSTOP)", lambda n: str(n["hangs"])),
    ("committed / attempted rounds", lambda n: f"{n['syncs_committed']} / {n['syncs_attempted']}"),
    (
        "digest mismatches (rounds committed by 2+ groups)",
        lambda n: f"{n['digest_mismatches']} (of {n['rounds_checked']})",
    ),
    ("goodput ratio to fault-free", lambda n: f"{n['goodput_ratio']:.3f}"),
    ("death to first commit s (median / p90)", lambda n: _stats(n["death_to_first_commit_s"], ("median", "p90"))),
    ("survivors' stall per hang s (median / max)", lambda n: _stats(n["hang_stall_s"], ("median", "max"))),
    ("survivors' stall per failure s (median / max)", lambda n: _stats(n["survivor_stall_s"], ("median", "max"))),
    (
        "peak memory of the job MiB: sum of PSS / sum of RSS",
        lambda n: f"{n['memory']['pss_mib']:,.0f} / {n['memory']['rss_mib']:,.0f} ({n['memory']['processes']} proc.)",
    ),
    ("final eval loss (vs fault-free)", lambda n: f"{n['final_eval_loss']:.4f} ({n['loss_gap']:+.2%})"),
    ("final eval loss vs data parallel, same tokens", lambda n: _vs(n["vs_data_parallel"])),
    ("step / training efficiency", lambda n: f"{n['step_efficiency']:.1%} / {n['training_efficiency']:.1%}"),
]


def table(figures: dict[str, dict[str, Any]], periods: dict[str, float | None]) -> str:
    rows = [[label, *(cell(n) for n in figures.values())] for label, cell in ROWS]
    rows.append(["fault-tolerant Llama blog: step / training efficiency", *(_blog(periods[k]) for k in figures)])
    return markdown_table(["", *figures], rows)


def targets(figures: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for name, n in figures.items():
        if name == FAULT_FREE:
            continue
        within = abs(n["loss_gap"]) <= LOSS_TOLERANCE
        mismatches = f"{n['digest_mismatches']} of {n['rounds_checked']} rounds committed by 2+ groups"
        lines += [
            f"{name}: 0 digest mismatches: {'PASS' if n['digest_mismatches'] == 0 else 'FAIL'} ({mismatches})",
            f"{name}: final eval loss within {LOSS_TOLERANCE:.0%} of fault-free: {'PASS' if within else 'FAIL'} "
            + f"({n['loss_gap']:+.2%})",
        ]
    return lines


def setup(job: JobConfig, runs: dict[str, Run], steps: int, how: str) -> str:
    faulty = next((r for name, r in runs.items() if name not in (FAULT_FREE, DATA_PARALLEL)), None)
    faults = json.loads(faulty.job_file.read_text())["faults"] if faulty else {"start_after": 0, "hang_every": 0}
    return (
        f"Streaming DiLoCo H={job.algo.sync_every}, P={job.algo.fragments}, τ={job.algo.delay}, {job.algo.quantize}; "
        f"{job.cluster.groups} groups x 1 CPU process (fork server, no spares), "
        f"{runs[FAULT_FREE].summary['parameters'] / 1e6:.2f}M parameters, {steps} inner steps per run ({how}). "
        f"Faulty runs: a random group SIGKILLed every period from {faults['start_after']:g} s, a SIGSTOP hang "
        f"every {faults['hang_every']:g} s (faults/seed_topology_*.yaml); every return a live recovery from a peer. "
        f"Peak memory: sampled every {MEMORY_EVERY_S:g} s over the supervisor and all its descendants. "
        "Efficiencies: see the docstring of experiments/scale/seed_topology.py."
    )


def data_parallel_figures(run: Run) -> dict[str, Any]:
    """What the data-parallel run of the same tokens reached (also written as JSON)."""
    s = run.summary
    keys = ("ok", "failure", "final_eval_loss", "wall_seconds", "bytes_per_token")
    return {key: s[key] for key in keys} | {"overrides": DATA_PARALLEL_OVERRIDES}


def data_parallel_line(figures: dict[str, Any] | None) -> str:
    """The data-parallel run in one line ("" before it ran)."""
    if figures is None:
        return ""
    how = ", ".join(figures["overrides"])
    if not figures["ok"]:
        return f"Data parallel ({how}): failed: {figures['failure']}"
    return (
        f"Data parallel ({how}, the same groups and tokens): final eval loss {figures['final_eval_loss']:.4f}, "
        f"{figures['wall_seconds']:.0f} s, {figures['bytes_per_token']:,.1f} bytes per token."
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 groups, a kill every 8 s, ~30 s per run: a smoke test")
    parser.add_argument("--minutes", type=float, help="least wall time of the fault-free run (default 11; --quick 0.4)")
    parser.add_argument("--faults", help="kill periods in seconds, comma-separated (default 60,15; --quick 8)")
    parser.add_argument(
        "--hang-every", type=float, help="seconds between SIGSTOP hangs (default 150; --quick 30: one hang)"
    )
    add_steps_argument(parser)
    add_output_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    cfg = settings(args)
    began = time.monotonic()
    job = compose_job(cfg.extra, EXPERIMENT)
    h = job.algo.sync_every
    check_steps(args.steps, h)
    with runs_root(args.keep_runs, EXPERIMENT) as root:
        steps, how = planned_steps(root, args.steps, cfg.minutes, cfg.calibration_s, h, EXPERIMENT, cfg.extra)
        shared = [f"trainer.max_steps={steps}", f"trainer.eval_batches={EVAL_BATCHES}", *cfg.extra]
        plans: list[tuple[str, float | None, list[str]]] = [(FAULT_FREE, None, ["faults=none"])]
        plans += [(run_name(p), p, [*faulty_overrides(p), *cfg.faults]) for p in cfg.kill_periods]
        plans.append((DATA_PARALLEL, None, DATA_PARALLEL_OVERRIDES))
        runs, memory = {}, {}
        for name, _, overrides in plans:
            started = time.monotonic()
            with Progress(name, root / name, steps), JobMemory() as sampler:
                runs[name] = run_one(name, overrides + shared, root / name, EXPERIMENT, keep_failure=True)
            memory[name] = sampler.figures()
            print(f"{name} run done in {(time.monotonic() - started) / 60:.1f} min", file=sys.stderr, flush=True)
            # The table so far after every run: a long experiment cut short still leaves its numbers.
            ddp = data_parallel_figures(runs[DATA_PARALLEL]) if DATA_PARALLEL in runs else None
            ddp_loss = ddp["final_eval_loss"] if ddp and ddp["ok"] else None
            figures = {
                other: numbers(run, runs[FAULT_FREE], memory[other], ddp_loss)
                for other, run in runs.items()
                if other != DATA_PARALLEL
            }
            periods = {name: p for name, p, _ in plans if name in figures}
            head = [setup(job, runs, steps, how), data_parallel_line(ddp)]
            text = "\n".join([*head, "", table(figures, periods), "", *targets(figures)])
            write_result("seed_topology.md", text, args.results)
            written = figures | ({DATA_PARALLEL: ddp} if ddp else {})
            write_result("seed_topology.json", json.dumps(written, indent=2), args.results)
        print(text)
        print(f"table written to {write_result('seed_topology.md', text, args.results)}", file=sys.stderr)
    print(f"total wall time {(time.monotonic() - began) / 60:.1f} min", file=sys.stderr)
    failed = [f"{name}: {run.summary['failure']}" for name, run in runs.items() if not run.summary["ok"]]
    if failed:
        sys.exit(f"run(s) failed: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
