"""The console view of a running job: what it waits for before its first step, then one
progress line drawn from the groups' metric files, and the ``done:`` line at its end."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from diloco.config.job import JobConfig
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl_tail

# The console's lines, also kept in run.log: run.py's hydra logging config sends this logger to
# the run's log file only (the console has the line already).
TRANSCRIPT = logging.getLogger("diloco.console")
CLEAR_LINE = "\r\x1b[K"  # a terminal's cursor back to the line's start, the line erased

# events.jsonl kinds that are faults, planned (``faults.*``) or not; restarts and recoveries are
# their answers, a skipped fault never hit anyone.
FAULT_EVENTS = (
    "kill",
    "hang",
    "break_lane",
    "nan",
    "lighthouse_down",
    "crash",
    "hung",
    "spare_crash",
    "lighthouse_crash",
    "lighthouse_hung",
)


def say(line: str, out: TextIO) -> None:
    """A line for the person watching: on the console (over the progress line a terminal shows
    in place, which the next update redraws below it), and in run.log."""
    print((CLEAR_LINE if out.isatty() else "") + line, file=out, flush=True)
    TRANSCRIPT.info(line)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60:d}:{seconds % 60:02d}"


def render_progress(
    step: int,
    max_steps: int,
    elapsed_s: float,
    last: dict[str, Any],
    *,
    eta_s: float | None = None,
    job_tokens_per_s: float | None = None,
    job_tflops: float | None = None,
    mfu: float | None = None,
    width: int = 24,
) -> str:
    """``step 120/300 [#########...] loss 2.31 eval 2.40@100 round 3 tok/s 9.1k TFLOP/s 0.12 MFU 31% 0:31<0:46``
    (the eval loss of step 100).

    ``tok/s`` and ``TFLOP/s`` are the whole job's (every group's), at the rate the caller gives:
    while training the groups' last logged steps', on the last line the job's average (summary.json's
    ``tokens_per_s``); ``mfu`` is the groups' mean (alike groups have alike peaks); ``eta_s`` is
    None until a step time has been measured (shown as ``?``).
    """
    frac = min(1.0, step / max_steps) if max_steps else 0.0
    filled = round(frac * width)
    parts = [f"step {step}/{max_steps}", f"[{'#' * filled}{'.' * (width - filled)}]"]
    if last.get("train/loss") is not None:
        parts.append(f"loss {last['train/loss']:.3f}")
    if last.get("eval/loss") is not None:  # the step it was measured at: the line repeats it until the next
        at = f"@{int(last['eval/step'])}" if last.get("eval/step") is not None else ""
        parts.append(f"eval {last['eval/loss']:.3f}{at}")
    if last.get("outer/round") is not None:
        parts.append(f"round {int(last['outer/round'])}")
    if job_tokens_per_s is not None:
        parts.append(f"tok/s {job_tokens_per_s / 1000:.1f}k")
    if job_tflops is not None:
        parts.append(f"TFLOP/s {job_tflops:.3g}")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    parts.append(f"{format_duration(elapsed_s)}<{'?' if eta_s is None else format_duration(eta_s)}")
    return " ".join(parts)


def remaining_seconds(first: tuple[float, int] | None, now: tuple[float, int], max_steps: int) -> float | None:
    """Time left at the step rate measured since ``first`` (elapsed s, step): start-up, imports
    and the first quorum are not steps, so a rate from time zero would overstate the rest."""
    if now[1] >= max_steps:
        return 0.0
    if first is None or now[1] <= first[1] or now[0] <= first[0]:
        return None
    rate = (now[1] - first[1]) / (now[0] - first[0])
    return (max_steps - now[1]) / rate


def render_outages(latest: dict[int, dict[str, Any]]) -> str:
    """`` | no quorum: group 1 for 12s``: groups that cannot reach the lighthouse say so on the console."""
    outages = [f"group {g} for {r['outer/no_quorum_s']:.0f}s" for g, r in latest.items() if r.get("outer/no_quorum_s")]
    return f" | no quorum: {', '.join(outages)}" if outages else ""


def render_starting(elapsed_s: float, groups: int, built: int, joined: int | None, log_every: int) -> str:
    """``starting: 2 of 2 groups built their model; waiting for the first quorum (0:20)``: what a
    job does before its first logged step, from what the run directory shows. ``built``: groups
    whose leader opened its metrics file (torch imported, model built, wandb started); ``joined``:
    groups with a commit record (through their first quorum); None for a job without rounds."""
    ready = built if joined is None else joined
    if ready == groups:
        doing = f"training; a line every trainer.log_every={log_every} steps"
    elif joined:
        doing = f"{joined} of {groups} groups joined the first quorum"
    elif built:
        waiting = "; waiting for the first quorum" if built == groups else ""
        doing = f"{built} of {groups} groups built their model{waiting}"
    else:
        doing = "workers importing torch and building the model"
    return f"starting: {doing} ({format_duration(elapsed_s)})"


def render_faults(counts: dict[str, int], heals: int, work_lost: bool = False) -> str:
    """``faults: 7 kill; 7 restarts, 6 heals from a peer`` from summary.json's event counts and heals,
    or ``no faults`` (``no other faults`` once the line said work was lost: losing it is a fault even
    when no event caused it). The restarts are the processes started again, the heals the live states
    taken from a peer: a restart after the job's end takes none, a group that sat out heals unrestarted,
    and a multi-host job's restarts are its torchrun's (counted from the commit logs) with no fault
    injected."""
    faults = [f"{n} {kind}" for kind, n in counts.items() if kind in FAULT_EVENTS and n]
    restarts = counts.get("restart", 0)
    recovered = [f"{restarts} restart{'' if restarts == 1 else 's'}"] if restarts else []
    recovered += [f"{heals} heal{'' if heals == 1 else 's'} from a peer"] if restarts or heals else []
    if faults:
        return f"faults: {', '.join(faults)}" + (f"; {', '.join(recovered)}" if recovered else "")
    if recovered:
        return f"{'other faults' if work_lost else 'faults'}: {', '.join(recovered)}"
    return "no other faults" if work_lost else "no faults"


def render_tokens(summary: dict[str, Any]) -> str:
    """``2,048,000 tokens``, or ``1,228,800 of the 2,048,000 planned tokens (a group that heals goes on
    from the job's step: the steps it was down are trained by no one)`` when the groups trained fewer."""
    seen, planned = summary["tokens_seen"], summary.get("tokens_planned")
    if planned is None or seen >= planned:
        return f"{seen:,} tokens"
    why = " (a group that heals goes on from the job's step: the steps it was down are trained by no one)"
    return f"{seen:,} of the {planned:,} planned tokens{why if summary['recoveries'] else ''}"


def render_lost_work(lost: dict[str, Any]) -> str | None:
    """``work lost: the model is the global state of step 360 of 1,500, and 2,280 group-steps trained
    never reached it (group 1: 1,140, group 2: 1,140)`` from summary.json's ``lost_work``; None when
    every step reached the model, so a job that trained apart says so instead of ``no faults``."""
    parts = []
    if lost["steps_short"]:
        parts.append(f"the model is the global state of step {lost['global_step']:,} of {lost['max_steps']:,}")
    if lost["group_steps_lost"]:
        groups = ", ".join(f"group {g}: {n:,}" for g, n in lost["per_group"].items() if n)
        model = "it" if parts else "the global model"
        parts.append(f"{lost['group_steps_lost']:,} group-steps trained never reached {model} ({groups})")
    return f"work lost: {', and '.join(parts)}" if parts else None


def render_done(summary: dict[str, Any], summary_path: Path) -> str:
    """The job's last line: ``done: eval loss 2.8389 (ppl 17.10); 245,760 tokens in 15s (34.7k tok/s
    over 7s of training); 3 rounds, 6/6 syncs committed; no faults; summary in RUN/summary.json`` (``failed:`` when summary.json is not ok; ``work lost: ...`` before the
    faults when steps never reached the global model, see ``render_lost_work``).

    tok/s is summary.json's ``tokens_per_s``: every group's tokens trained in this run (a resumed
    job's before its checkpoint left out) over the longest group's training time (from its first
    quorum to its last step, syncs and evaluations included).
    """
    parts = [
        f"eval loss {summary['final_eval_loss']:.4f} (ppl {summary['final_eval_ppl']:.2f})",
        (
            f"{render_tokens(summary)} in {summary['wall_seconds']:.0f}s "
            f"({summary['tokens_per_s'] / 1000:.1f}k tok/s over {summary['train_seconds']:.0f}s of training)"
        ),
    ]
    if summary["algo"] != "local":
        committed, attempted = summary["syncs_committed"], summary["syncs_attempted"]
        parts.append(f"{summary['rounds']} rounds, {committed}/{attempted} syncs committed")
    lost = render_lost_work(summary["lost_work"])
    if lost:
        parts.append(lost)
    parts.append(render_faults(summary["faults"], summary["recoveries"], work_lost=lost is not None))
    parts.append(f"summary in {summary_path}")
    return f"{'done' if summary['ok'] else 'failed'}: {'; '.join(parts)}"


@dataclass
class ProgressView:
    """Follows ``metrics/group*.jsonl`` and redraws the slowest group's progress; before any
    group has logged a step, what the job is waiting for (``commits``: the groups' commit logs,
    empty for a job without rounds).

    On a terminal the line is redrawn in place. Elsewhere (CI, a pipe) a line is printed when
    something new was logged, at most every ``plain_interval_s``, and with nothing new every
    ``quiet_interval_s``, saying for how long (a slow model logs every ``log_every`` steps only),
    so logs stay readable.
    """

    files: list[Path]
    max_steps: int
    out: TextIO = sys.stdout
    commits: list[Path] = field(default_factory=list)
    log_every: int = 10
    plain_interval_s: float = 10.0
    quiet_interval_s: float = 30.0
    _offsets: dict[Path, int] = field(default_factory=dict)
    _latest: dict[Path, dict[str, Any]] = field(default_factory=dict)
    _last_plain: float = -1e9
    _news_at: float = 0.0  # elapsed s when a group last logged
    _first_progress: tuple[float, int] | None = None  # (elapsed s, slowest group's step) when it was first seen
    _seen: tuple[float, int] | None = None  # the same for the slowest group's current step

    @classmethod
    def for_job(cls, job: JobConfig, paths: RunPaths, out: TextIO) -> ProgressView:
        """The view of ``job`` running in ``paths`` (``algo=local`` has no rounds, so no commit logs)."""
        groups = range(job.cluster.groups)
        rounds = job.algo.name != "local"
        return cls(
            [paths.metrics(g) for g in groups],
            job.trainer.max_steps,
            out,
            commits=[paths.commits(g) for g in groups] if rounds else [],
            log_every=job.trainer.log_every,
        )

    def update(self, elapsed_s: float) -> None:
        """Take in what the groups logged and redraw; on a plain console, print if due."""
        if self._read():
            self._news_at = elapsed_s
        if not self._latest:
            self._show(self._starting_line(elapsed_s), elapsed_s, self.plain_interval_s)
            return
        line = self._progress_line(elapsed_s)
        quiet_s = elapsed_s - self._news_at
        if quiet_s >= self.quiet_interval_s:
            line += f" | nothing logged for {format_duration(quiet_s)} (trainer.log_every={self.log_every} steps)"
        news = self._news_at > self._last_plain
        interval_s = self.plain_interval_s if news else self.quiet_interval_s
        if self._seen[1] >= self.max_steps:
            interval_s = math.inf  # the last step's line is ``finish``'s, with the job's average rate
        self._show(line, elapsed_s, interval_s)

    def finish(self, elapsed_s: float, job_tokens_per_s: float) -> None:
        """The last line, its tok/s the job's average (the ``done:`` line's, summary.json's
        ``tokens_per_s``) instead of the last logged steps' rate; TFLOP/s and MFU scaled alike."""
        self._read()
        say(self._progress_line(elapsed_s, job_tokens_per_s), self.out)

    def _read(self) -> bool:
        """Take in what the groups logged since the last read; whether there was anything."""
        news = False
        for path in self.files:
            records, self._offsets[path] = read_jsonl_tail(path, self._offsets.get(path, 0))
            for record in records:
                latest = self._latest.setdefault(path, {})
                latest.update({k: v for k, v in record.items() if v is not None})
                if record.get("eval/loss") is not None:
                    latest["eval/step"] = record.get("step")
            news = news or bool(records)
        return news

    def _show(self, line: str, elapsed_s: float, interval_s: float) -> None:
        tty = self.out.isatty()
        if tty:
            self.out.write(CLEAR_LINE + line)
            self.out.flush()
        if elapsed_s - self._last_plain >= interval_s:
            self._last_plain = elapsed_s
            if tty:
                TRANSCRIPT.info(line)  # redrawn in place on the console; one line every interval in run.log
            else:
                say(line, self.out)

    def _starting_line(self, elapsed_s: float) -> str:
        built = sum(path.exists() for path in self.files)
        joined = sum(path.exists() and path.stat().st_size > 0 for path in self.commits) if self.commits else None
        return render_starting(elapsed_s, len(self.files), built, joined, self.log_every)

    def _progress_line(self, elapsed_s: float, job_tokens_per_s: float | None = None) -> str:
        slowest = min(self._latest.values(), key=lambda r: r.get("step", 0), default={})
        step = int(slowest.get("step", 0))
        if self._first_progress is None and step > 0:
            self._first_progress = (elapsed_s, step)
        if self._seen is None or self._seen[1] != step:
            self._seen = (elapsed_s, step)
        rates = _present(self._latest.values(), "train/tokens_per_s")
        tflops = _present(self._latest.values(), "train/tflops")
        mfus = _present(self._latest.values(), "train/mfu")
        rate, scale = (sum(rates) if rates else None), 1.0
        if job_tokens_per_s is not None:
            # TFLOP/s and MFU are proportional to tok/s: every group trains the same model.
            scale = job_tokens_per_s / rate if rate else 1.0
            rate = job_tokens_per_s
        line = render_progress(
            step,
            self.max_steps,
            elapsed_s,
            slowest,
            eta_s=self._eta(elapsed_s, slowest),
            job_tokens_per_s=rate,
            job_tflops=scale * sum(tflops) if tflops else None,
            mfu=scale * sum(mfus) / len(mfus) if mfus else None,
        )
        return line + render_outages({i: self._latest.get(path, {}) for i, path in enumerate(self.files)})

    def _eta(self, elapsed_s: float, slowest: dict[str, Any]) -> float | None:
        """Time left at the step rate measured since the first logged step, else (one logged step
        so far) at the slowest group's own time per step; counted down from when its step was seen."""
        seen_at, step = self._seen
        left = remaining_seconds(self._first_progress, self._seen, self.max_steps)
        if left is None and slowest.get("train/step_ms"):
            left = max(0, self.max_steps - step) * slowest["train/step_ms"] / 1000
        return None if left is None else max(0.0, left - (elapsed_s - seen_at))


def _present(records: Iterable[dict[str, Any]], key: str) -> list[float]:
    """``key``'s latest value in each group's records that has one."""
    return [r[key] for r in records if r.get(key) is not None]
