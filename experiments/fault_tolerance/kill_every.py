"""The fault-tolerant Llama experiment at CPU scale: one DiLoCo job, without faults and with a
group SIGKILLed every 15 s.

Four replica groups of one CPU process each train the tiny model with DiLoCo, H=20
(``conf/experiment/fault_tolerance.yaml``). The same job runs three times, one after the other:

- ``faults=none``: nothing is injected;
- ``faults=kill_every``: a random group is SIGKILLed every 15 s (never the same group twice
  in a row). The supervisor restarts it after its backoff; there are no checkpoints in this
  system, so every return is a live recovery: the new process takes θ_g, the outer optimizer
  state and the step from a live peer at its first quorum;
- the same with ``cluster.spares=1`` (left out with ``--no-spares``): a warm spare, built and
  waiting, takes the killed group's place at once and heals the same way; the pool is refilled.

Every run trains the same ``trainer.max_steps``, chosen from a short fault-free calibration so
that each lasts at least ``--minutes``. Everything reported comes from the run directories:
``summary.json`` (goodput, time to heal, survivors' stall, final eval loss, per-group digests),
``events.jsonl`` (kills and restarts) and the groups' commit logs, which hold the records of
every process a group had (summary.json sees only each group's last process).

    python -m experiments.fault_tolerance.kill_every            # 3 x >= 5 minutes, after a ~30 s calibration
    python -m experiments.fault_tolerance.kill_every --quick    # 3 x ~45 s with a kill every 10 s: a smoke test

Prints a markdown table and the target checks and writes them to
experiments/results/fault_tolerance.md (the numbers also to fault_tolerance.json); plots train
loss against wall time for every run, kills and recoveries marked, to
experiments/results/fault_tolerance.png when matplotlib is installed (``pip install -e .[experiments]``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from diloco.launch.summary import FAILURES
from diloco.outer.perf_model import death_to_commit_seconds
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from experiments.common import (
    NO_MATPLOTLIB,
    RESULTS,
    ClusterRun,
    add_output_arguments,
    add_steps_argument,
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

EXPERIMENT = "fault_tolerance"
FAULT_FREE = "fault-free"
FAULTY = "faulty"
SPARES = "faulty, 1 warm spare"
MIN_GOODPUT_WITH_SPARES = 0.95  # goodput ratio to fault-free with a warm spare
MAX_DEATH_TO_COMMIT_S = 1.0  # median seconds from a group's death to its replacement's first committed round
LOSS_TOLERANCE = 0.03  # final eval loss of the faulty run within 3% of the fault-free one
MAX_STALL_S = 1.0  # survivors' median stall per failure
MARGIN = 1.15  # calibration on a noisy machine: aim past the minimum wall time
ENDLESS = 100_000  # max_steps of the calibration job, which is stopped once measured
WARMUP_STEPS = 40  # calibration: leave out start-up (the other groups' processes compete for the cores)
EVAL_POINTS = 10  # evaluations on the way, for the plot
HEAL_FALLBACK_S = 10.0  # a restart's time to heal when the run measured none


@dataclass
class Settings:
    minutes: float
    kill_every: float
    start_after: float
    calibration_s: float
    bin_s: float  # the plot's time bins for the mean over groups
    extra: list[str]  # overrides of both runs


@dataclass
class Recovery:
    """A failure of a group, its restart (if any) and whether that new process healed from a peer."""

    group: int
    failed_at: float
    restarted_at: float | None
    healed_at: float | None  # the restarted process's first record holding a peer's state (committed or healed)


@dataclass
class Run:
    name: str
    h: int
    summary: dict[str, Any]
    start: float  # time.time() just before launch: the plot's zero
    events: list[dict[str, Any]]
    commits: dict[int, list[dict[str, Any]]]
    metrics: dict[int, list[dict[str, Any]]]
    job_file: Path

    @cached_property
    def join_s(self) -> float:
        """cluster.timeouts.join of the job: how long a round waits for a group still counted healthy."""
        return json.loads(self.job_file.read_text())["cluster"]["timeouts"]["join"]

    def count(self, kind: str) -> int:
        return self.summary["faults"].get(kind, 0)

    def window_s(self) -> float:
        """Seconds between a group's committed rounds (median over every group and round)."""
        gaps = []
        for records in self.commits.values():
            times = [r["time"] for r in records if r["committed"]]
            gaps += [b - a for a, b in zip(times, times[1:])]
        return statistics.median(gaps) if gaps else math.nan

    def round_s(self) -> float:
        """Seconds a committed round holds a group (median)."""
        held = [r["sync_ms"] / 1000 for records in self.commits.values() for r in records if r["committed"]]
        return statistics.median(held) if held else math.nan

    def predicted_death_to_commit(self) -> float:
        """diloco.outer.perf_model's expected death-to-commit, fed with this run's measured readiness, window and round."""
        ready = self.summary["death_to_ready_s"]
        if not ready.get("count"):
            return math.nan
        return death_to_commit_seconds(ready["mean"], self.window_s(), self.join_s, self.round_s())

    @cached_property
    def _restarts(self) -> dict[int, list[float]]:
        per_group: dict[int, list[float]] = defaultdict(list)
        for e in self.events:
            if e["kind"] == "restart":
                per_group[e["group"]].append(e["time"])
        return {group: sorted(times) for group, times in per_group.items()}

    @cached_property
    def _back_times(self) -> dict[int, list[float]]:
        """Per group, in time order: records of a process holding a peer's state (committed or healed, after a heal)."""
        return {
            group: sorted(
                c["time"] for c in records if (c["committed"] or c.get("healed")) and c.get("recoveries", 0) >= 1
            )
            for group, records in self.commits.items()
        }

    def restarts_of(self, group: int) -> list[float]:
        return self._restarts.get(group, [])

    def healed_at(self, group: int, restarted: float) -> float | None:
        """When the process of ``group`` started at ``restarted`` first held a peer's state (None: never).

        A group's commit log holds the records of all its processes in turn; each process
        counts its own heals (``recoveries``), so a committed or healed record (healed: the
        job's final state taken from a finished peer in a closing round) of the restarted
        process with recoveries >= 1 means it took its state from a live peer and is back.
        """
        restarts = self.restarts_of(group)
        i = bisect.bisect_right(restarts, restarted)
        until = restarts[i] if i < len(restarts) else math.inf  # the next process of the group
        times = self._back_times.get(group, [])
        j = bisect.bisect_right(times, restarted)
        return times[j] if j < len(times) and times[j] < until else None

    def recoveries(self) -> list[Recovery]:
        """Per failure: the restart that followed it and whether the new process healed."""
        found = []
        for event in (e for e in self.events if e["kind"] in FAILURES):
            group = event["group"]
            restarts = self.restarts_of(group)
            i = bisect.bisect_left(restarts, event["time"])
            restarted = restarts[i] if i < len(restarts) else None
            healed = self.healed_at(group, restarted) if restarted is not None else None
            found.append(Recovery(group, event["time"], restarted, healed))
        return found

    def healed(self) -> int:
        return sum(r.healed_at is not None for r in self.recoveries())

    def restarts(self) -> list[tuple[int, float]]:
        """(group, time) of every restart."""
        return [(group, t) for group, times in self._restarts.items() for t in times]

    def healed_restarts(self) -> int:
        """Restarted processes that healed from a peer, each restart once (a hang before a kill is not a second one)."""
        return sum(self.healed_at(group, t) is not None for group, t in self.restarts())

    def goodput_to_last_step(self) -> float:
        """summary.json's committed tokens per second from launch to the last training step (the end wait left out)."""
        return self.summary["goodput_tokens_per_s"] * self.summary["wall_seconds"] / self.training_times()[1]

    def training_times(self) -> tuple[float, float]:
        """Seconds from launch to the first group's last step and to the last logged step of any group."""
        final = self.summary["steps"]
        records = [r for group in self.metrics.values() for r in group if r.get("train/loss") is not None]
        first_done = min((r["time"] for r in records if r["step"] >= final), default=math.nan)
        return first_done - self.start, max((r["time"] for r in records), default=math.nan) - self.start

    def early_failures(self) -> list[Recovery]:
        """Unrecovered failures before the job's first committed round: no group held a state to
        heal from yet, so the replacement started from the shared initial one, as every group did."""
        commits = [c["time"] for records in self.commits.values() for c in records if c["committed"]]
        first_commit = min(commits, default=math.inf)
        return [r for r in self.recoveries() if r.healed_at is None and r.failed_at < first_commit]

    def late_failures(self) -> list[Recovery]:
        """Unrecovered failures the job gave no time to recover from.

        The first group finished less than a restart's usual way back (backoff + the run's
        longest measured time to heal) after the failure: no peer was left to heal from.
        """
        heal = self.summary["time_to_heal_s"].get("max", HEAL_FALLBACK_S) + 1.0
        first_done = self.training_times()[0] + self.start
        return [r for r in self.recoveries() if r.healed_at is None and first_done - r.failed_at < heal]


def last_record(run: ClusterRun, group: int) -> dict[str, Any] | None:
    records = [r for r in run.metrics(group) if "train/loss" in r]
    return records[-1] if records else None


def calibrate(root: Path, window_s: float, experiment: str = EXPERIMENT, overrides: tuple[str, ...] = ()) -> float:
    """Inner steps per second of the job, fault-free, all groups running (median over groups)."""
    job = compose_job(["faults=none", f"trainer.max_steps={ENDLESS}", *overrides], experiment)
    groups = range(job.cluster.groups)
    with ClusterRun(job, root / "calibration") as run:
        run.cluster.wait_for(
            lambda: all((r := last_record(run, g)) is not None and r["step"] >= WARMUP_STEPS for g in groups),
            timeout_s=300.0,
            what=f"every group to reach step {WARMUP_STEPS}",
            poll_s=0.5,
        )
        first = [last_record(run, g) for g in groups]
        time.sleep(window_s)
        last = [last_record(run, g) for g in groups]
    return statistics.median((b["step"] - a["step"]) / (b["time"] - a["time"]) for a, b in zip(first, last))


def plan_steps(rate: float, minutes: float, h: int) -> int:
    """Steps for at least ``minutes`` at ``rate`` steps/s, a multiple of H (the last round reaches θ_g)."""
    return max(2 * h, math.ceil(rate * minutes * 60 * MARGIN / h) * h)


def planned_steps(
    root: Path,
    steps: int | None,
    minutes: float,
    window_s: float,
    h: int,
    experiment: str = EXPERIMENT,
    extra: list[str] | None = None,
) -> tuple[int, str]:
    """``steps`` (``--steps``) if given, else enough for ``minutes`` at a calibration's rate; and how chosen."""
    if steps is not None:
        return steps, "--steps"
    rate = calibrate(root, window_s, experiment, tuple(extra or ()))
    steps = plan_steps(rate, minutes, h)
    print(f"calibration: {rate:.2f} steps/s per group -> trainer.max_steps={steps}", file=sys.stderr, flush=True)
    return steps, f"calibrated at {rate:.2f} steps/s"


def run_one(
    name: str, overrides: list[str], run_dir: Path, experiment: str = EXPERIMENT, keep_failure: bool = False
) -> Run:
    """Run the job composed from ``experiment`` and ``overrides``; ``keep_failure``: a job the
    supervisor gave up on is read back (summary.json ``ok`` false, ``failure``) instead of raising."""
    job = compose_job(overrides, experiment)
    start = time.time()
    run_job(job, run_dir, keep_failure=keep_failure)
    return load_run(name, run_dir, job.algo.sync_every, start)


def load_run(name: str, run_dir: Path, h: int, start: float) -> Run:
    """A finished job's records read back from its run directory (``start``: time.time() at its launch)."""
    paths = RunPaths(run_dir)
    summary = json.loads(paths.summary.read_text())
    groups = range(summary["groups"])
    return Run(
        name=name,
        h=h,
        summary=summary,
        start=start,
        events=read_jsonl(paths.events),
        commits={g: read_jsonl(paths.commits(g)) for g in groups},
        metrics={g: read_jsonl(paths.metrics(g)) for g in groups},
        job_file=paths.job,
    )


def _pair(stats: dict[str, float]) -> str:
    if not stats.get("count"):
        return "n/a"
    return f"{stats['median']:.2f} / {stats['max']:.2f} (n={stats['count']})"


def _mean(stats: dict[str, float]) -> str:
    return f"{stats['mean']:.2f}" if stats.get("count") else "n/a"


def _predicted(n: dict[str, Any]) -> str:
    measured = n["death_to_first_commit_s"]
    if not measured.get("count") or math.isnan(n["predicted_death_to_commit_s"]):
        return "n/a"
    return f"{n['predicted_death_to_commit_s']:.2f} / {measured['mean']:.2f} (window {n['window_s']:.2f} s)"


def _choices(choices: dict[str, Any]) -> str:
    return f"{choices['wait']} / {choices['go_on']}" if choices else "n/a"


def _choice_costs(choices: dict[str, Any]) -> str:
    predicted, actual = choices.get("predicted_cost_s", {}), choices.get("actual_cost_s", {})
    if not actual.get("count"):
        return "n/a"
    return f"{predicted['mean']:.2f} / {actual['mean']:.2f} (n={actual['count']})"


def _spread(stats: dict[str, float]) -> str:
    if not stats.get("count"):
        return "n/a"
    return f"{stats['median']:.2f} / {stats['p90']:.2f} / {stats['max']:.2f} (n={stats['count']})"


def digests_equal(summary: dict[str, Any]) -> tuple[bool, str]:
    """docs/design.md, invariant 1, from outside: every group that reported ended holding the same
    θ_g and outer state."""
    results = summary["per_group"]
    digests = {r.get("digest") for r in results}
    ok = len(digests) == 1 and None not in digests
    rounds = "/".join(str(r) for r in sorted({r.get("rounds") for r in results}))
    detail = f"{len(results)}/{summary['groups']} groups reported, round {rounds}"
    if missing := summary.get("groups_missing_results"):
        detail += f"; no result from group {', '.join(map(str, missing))}"
    return ok, f"{'yes' if ok else 'no'} ({detail})"


def numbers(run: Run, base: Run) -> dict[str, Any]:
    """Every figure of the table for one run (also written as JSON)."""
    s = run.summary
    return {
        "wall_seconds": s["wall_seconds"],
        "training_ended_s": run.training_times()[1],
        "steps": s["steps"],
        "kills": run.count("kill"),
        "restarts": run.count("restart"),
        "spare_takeovers": sum(e["kind"] == "restart" and "spare" in e for e in run.events),
        "recoveries": run.healed(),
        "late_failures": len(run.late_failures()),
        "early_failures": len(run.early_failures()),
        "summary_recoveries": s["recoveries"],
        "syncs_committed": s["syncs_committed"],
        "syncs_attempted": s["syncs_attempted"],
        "goodput_tokens_per_s": s["goodput_tokens_per_s"],
        "goodput_ratio": s["goodput_tokens_per_s"] / base.summary["goodput_tokens_per_s"],
        "goodput_to_last_step": run.goodput_to_last_step(),
        "goodput_to_last_step_ratio": run.goodput_to_last_step() / base.goodput_to_last_step(),
        "time_to_heal_s": s["time_to_heal_s"],
        "death_to_first_commit_s": s["death_to_first_commit_s"],
        "death_to_ready_s": s["death_to_ready_s"],
        "predicted_death_to_commit_s": run.predicted_death_to_commit(),
        "window_s": run.window_s(),
        "survivor_stall_s": s["survivor_stall_s"],
        "recovery_choices": s.get("recovery_choices", {}),
        "final_eval_loss": s["final_eval_loss"],
        "digests_equal": digests_equal(s)[0],
        "faults": s["faults"],
    }


ROWS = [
    ("wall time s", lambda n, s: f"{n['wall_seconds']:.0f}"),
    ("last training step logged at s", lambda n, s: f"{n['training_ended_s']:.0f}"),
    ("inner steps per group", lambda n, s: str(n["steps"])),
    ("kills injected", lambda n, s: str(n["kills"])),
    ("restarts (of them by a warm spare)", lambda n, s: f"{n['restarts']} ({n['spare_takeovers']})"),
    ("recoveries (restarted groups healed)", lambda n, s: str(n["recoveries"])),
    ("committed / attempted syncs", lambda n, s: f"{n['syncs_committed']} / {n['syncs_attempted']}"),
    ("goodput (committed tokens/s)", lambda n, s: f"{n['goodput_tokens_per_s']:,.0f}"),
    ("goodput ratio faulty / fault-free", lambda n, s: f"{n['goodput_ratio']:.3f}"),
    (
        "goodput up to the last training step (ratio)",
        lambda n, s: f"{n['goodput_to_last_step']:,.0f} ({n['goodput_to_last_step_ratio']:.3f})",
    ),
    ("time to heal s (median / max)", lambda n, s: _pair(n["time_to_heal_s"])),
    ("death to first commit s (median / p90 / max)", lambda n, s: _spread(n["death_to_first_commit_s"])),
    ("death to the replacement's first ask s (mean)", lambda n, s: _mean(n["death_to_ready_s"])),
    ("death to first commit s: perf_model's prediction / measured (means)", lambda n, s: _predicted(n)),
    ("survivors' stall per failure s (median / max)", lambda n, s: _pair(n["survivor_stall_s"])),
    ("recovery choices: wait / go on", lambda n, s: _choices(n["recovery_choices"])),
    ("cost per death, group-s: predicted / measured (means)", lambda n, s: _choice_costs(n["recovery_choices"])),
    ("final eval loss", lambda n, s: f"{n['final_eval_loss']:.4f}"),
    ("digests of all groups equal", lambda n, s: digests_equal(s)[1]),
]


def table(runs: dict[str, Run], figures: dict[str, dict[str, Any]]) -> str:
    cells = [[label, *(cell(figures[name], run.summary) for name, run in runs.items())] for label, cell in ROWS]
    return markdown_table(["", *runs], cells)


def targets(figures: dict[str, dict[str, Any]]) -> list[str]:
    clean, faulty = figures[FAULT_FREE], figures[FAULTY]
    loss, base = faulty["final_eval_loss"], clean["final_eval_loss"]
    gap = (loss - base) / base
    stall = faulty["survivor_stall_s"]
    stall_median = stall["median"] if stall.get("count") else math.nan
    heals = faulty["time_to_heal_s"].get("count", 0)
    kills, healed, restarts = faulty["kills"], faulty["recoveries"], faulty["restarts"]
    recovered = kills > 0 and healed >= kills and heals == restarts
    loss_line = (
        f"final eval loss within {LOSS_TOLERANCE:.0%} of fault-free: {verdict(abs(gap) <= LOSS_TOLERANCE)} "
        f"({loss:.4f} vs {base:.4f}, {gap:+.2%})"
    )
    stall_line = (
        f"survivors stall under {MAX_STALL_S:.0f} s per failure (median): {verdict(stall_median < MAX_STALL_S)} "
        f"(median {stall_median:.2f} s over {stall.get('count', 0)} failures)"
    )
    recovery_line = (
        f"every killed group recovers: {verdict(recovered)} ({healed} healed restarts for {kills} kills; "
        f"time to heal measured for {heals} of {restarts} restarts; "
        f"{faulty['late_failures']} kill(s) too close to the end of the job to recover, "
        f"{faulty['early_failures']} before its first commit, with nothing to recover)"
    )
    lines = [loss_line, stall_line, recovery_line]
    if spared := figures.get(SPARES):
        back = spared["death_to_first_commit_s"]
        back_median = back["median"] if back.get("count") else math.nan
        lines += [
            f"with a warm spare, goodput ratio >= {MIN_GOODPUT_WITH_SPARES}: "
            f"{verdict(spared['goodput_ratio'] >= MIN_GOODPUT_WITH_SPARES)} ({spared['goodput_ratio']:.3f}; "
            f"without: {faulty['goodput_ratio']:.3f})",
            f"with a warm spare, median death to first commit <= {MAX_DEATH_TO_COMMIT_S:g} s: "
            f"{verdict(back_median <= MAX_DEATH_TO_COMMIT_S)} ({back_median:.2f} s over {back.get('count', 0)} "
            f"deaths; without: {_spread(faulty['death_to_first_commit_s'])})",
        ]
    return lines


def notes(runs: dict[str, Run]) -> list[str]:
    """What the table does not show but a reader should know: every failure that did not heal, and why."""
    lines = []
    for run in runs.values():
        counts = ", ".join(f"{k} {v}" for k, v in sorted(run.summary["faults"].items())) or "none"
        lines.append(
            f"- {run.name}: events: {counts}; summary.json recoveries (last process of each group): "
            f"{run.summary['recoveries']}"
        )
        first_done = run.training_times()[0]
        late, early = run.late_failures(), run.early_failures()
        for r in run.recoveries():
            if r.healed_at is not None:
                continue
            what = "never restarted" if r.restarted_at is None else f"restarted at {r.restarted_at - run.start:.1f}s"
            why = " (too late: no peer left to heal from)" if r in late else ""
            why = " (before the job's first commit: no state to heal from)" if r in early else why
            lines.append(
                f"  - group {r.group} failed at {r.failed_at - run.start:.1f}s, {what}, never healed; the first "
                f"group finished at {first_done:.1f}s{why}"
            )
        if ends := [e["group"] for e in run.events if e["kind"] == "stopped_at_end"]:
            stopped = ", ".join(f"{e['elapsed']:.0f}s" for e in run.events if e["kind"] == "stopped_at_end")
            lines.append(f"  - stopped by the supervisor at the end (behind for good): group {ends} at {stopped}")
    return lines


def curves(run: Run, key: str) -> dict[int, tuple[list[float], list[float]]]:
    """Per group: (seconds since launch, value) of every record holding ``key``."""
    out = {}
    for group, records in run.metrics.items():
        points = [(r["time"] - run.start, r[key]) for r in records if r.get(key) is not None]
        out[group] = ([t for t, _ in points], [v for _, v in points])
    return out


def mean_curve(per_group: dict[int, tuple[list[float], list[float]]], bin_s: float) -> tuple[list[float], list[float]]:
    """The mean over groups in time bins (groups log at different moments, and a killed group not at all)."""
    bins: dict[int, list[float]] = defaultdict(list)
    for times, values in per_group.values():
        for t, v in zip(times, values):
            bins[int(t // bin_s)].append(v)
    keys = sorted(bins)
    return [(k + 0.5) * bin_s for k in keys], [statistics.fmean(bins[k]) for k in keys]


def plot(runs: dict[str, Run], path: Path, bin_s: float) -> str:
    """Train loss against wall time, one panel per run; returns what was written or why not."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(len(runs), 1, figsize=(13, 4.3 * len(runs)), sharex=True, sharey=True)
    reference = mean_curve(curves(runs[FAULT_FREE], "train/loss"), bin_s)
    losses = sorted(v for run in runs.values() for _, values in curves(run, "train/loss").values() for v in values)
    # The first steps' loss (ln 256 = 5.5) would flatten everything after: clip the top 2%.
    top = losses[int(0.98 * (len(losses) - 1))] if losses else 1.0
    for ax, run in zip(axes, runs.values()):
        ax.set_ylim(0.97 * losses[0] if losses else 0.0, top)
        for group, (times, values) in curves(run, "train/loss").items():
            ax.plot(times, values, lw=0.7, alpha=0.4, label=f"group {group} train loss")
        ax.plot(
            *mean_curve(curves(run, "train/loss"), bin_s), color="black", lw=1.6, label="train loss, mean over groups"
        )
        if run.name != FAULT_FREE:
            ax.plot(*reference, color="grey", lw=1.2, ls="--", label="fault-free mean (above)")
        evals = [(t, v) for times, values in curves(run, "eval/loss").values() for t, v in zip(times, values)]
        if evals:
            ax.scatter(*zip(*evals), s=14, color="purple", zorder=3, label="eval loss (each group)")
        _mark_faults(ax, run, top)
        ax.set_title(f"{run.name}: {run.count('kill')} kills, {run.healed()} recoveries", loc="left")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    axes[-1].set_xlabel("seconds since launch")
    fig.suptitle("DiLoCo, 4 groups, H=20: train loss vs wall time (red: SIGKILL of group gN, green: it healed)")
    return save_figure(fig, path)


def _mark_faults(ax: Any, run: Run, top: float) -> None:
    for i, r in enumerate(run.recoveries()):
        ax.axvline(r.failed_at - run.start, color="red", lw=1.0, alpha=0.8, label="kill" if i == 0 else None)
        ax.text(r.failed_at - run.start, top, f" g{r.group}", color="red", fontsize=7, va="top")
    end = run.summary["wall_seconds"]
    ax.axvline(end, color="black", lw=1.0, ls="--", label=f"job ended ({end:.0f} s, summary.json wall time)")
    healed = [r.healed_at - run.start for r in run.recoveries() if r.healed_at is not None]
    for i, t in enumerate(healed):
        label = "healed (restarted group's first commit)" if i == 0 else None
        ax.axvline(t, color="green", lw=1.1, ls=":", label=label)


def settings(args: argparse.Namespace) -> Settings:
    if args.quick:
        # A smoke test: a kill that lands in the last seconds leaves a restarted group that
        # cannot heal, and the supervisor waits cluster.timeouts.quorum (60 s) before stopping
        # it; 20 s keeps the test short. The default run keeps the config's timeouts.
        return Settings(args.minutes or 0.75, args.kill_every or 10.0, 6.0, 5.0, 2.0, ["cluster.timeouts.quorum=20"])
    return Settings(args.minutes or 5.0, args.kill_every or 15.0, 20.0, 20.0, 5.0, [])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~60 s per run, a kill every 10 s: a smoke test")
    parser.add_argument("--minutes", type=float, help="least wall time of each run (default 5; --quick: 0.75)")
    parser.add_argument("--kill-every", type=float, help="seconds between kills (default 15; --quick: 10)")
    add_steps_argument(parser)
    parser.add_argument(
        "--no-spares", dest="spares", action="store_false", help="leave out the faulty run with a warm spare"
    )
    add_output_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    stop_on_sigterm()
    cfg = settings(args)
    began = time.monotonic()
    h = compose_job([], EXPERIMENT).algo.sync_every
    with runs_root(args.keep_runs, EXPERIMENT) as root:
        steps, how = planned_steps(root, args.steps, cfg.minutes, cfg.calibration_s, h)
        eval_every = max(h, round(steps / EVAL_POINTS / h) * h)
        shared = [
            f"trainer.max_steps={steps}",
            f"trainer.eval_every={eval_every}",
            "trainer.eval_batches=8",
            *cfg.extra,
        ]
        faults = ["faults=kill_every", f"faults.kill_every={cfg.kill_every}", f"faults.start_after={cfg.start_after}"]
        runs = {}
        plans = [(FAULT_FREE, ["faults=none"]), (FAULTY, faults)]
        plans += [(SPARES, [*faults, "cluster.spares=1"])] if args.spares else []
        for name, overrides in plans:
            started = time.monotonic()
            runs[name] = run_one(name, overrides + shared, root / name)
            print(f"{name} run done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
        figures = {name: numbers(run, runs[FAULT_FREE]) for name, run in runs.items()}
        setup = (
            f"DiLoCo H={h}, 4 groups x 1 CPU process, {runs[FAULT_FREE].summary['parameters'] / 1e6:.2f}M parameters, "
            f"{steps} inner steps per run ({how}); faulty run: SIGKILL of a random group every {cfg.kill_every:g} s "
            f"from {cfg.start_after:g} s, never the same group twice in a row, every return a live recovery from a "
            "peer: fresh workers after cluster.restart_backoff, or (last column) a warm spare that takes over at "
            "once (cluster.spares=1). Stall and heal times: median / max over failures (n)."
        )
        folder = Path(args.results) if args.results else RESULTS
        drawn = plot(runs, folder / "fault_tolerance.png", cfg.bin_s)
        text = "\n".join([setup, "", table(runs, figures), "", *targets(figures), "", "Notes:", *notes(runs), drawn])
        print(text)
        print(f"table written to {write_result('fault_tolerance.md', text, args.results)}", file=sys.stderr)
        write_result("fault_tolerance.json", json.dumps(figures, indent=2), args.results)
    print(f"total wall time {time.monotonic() - began:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
