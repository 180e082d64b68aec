"""The console view of a running job: one progress line drawn from the groups' metric files."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from diloco.train.logger import read_jsonl_tail

# The console's lines, also kept in run.log: run.py's hydra logging config sends this logger to
# the run's log file only (the console has the line already).
TRANSCRIPT = logging.getLogger("diloco.console")


def say(line: str, out: TextIO) -> None:
    """A line for the person watching: on the console, and in run.log."""
    print(line, file=out, flush=True)
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
    """``step 120/300 [#########...] loss 2.31 eval 2.40 round 3 tok/s 9.1k TFLOP/s 0.12 MFU 31% 0:31<0:46``.

    ``tok/s`` and ``TFLOP/s`` are the whole job's (every group's), as in summary.json; ``mfu``
    is the groups' mean (alike groups have alike peaks); ``eta_s`` is None until a rate has
    been measured (shown as ``?``).
    """
    frac = min(1.0, step / max_steps) if max_steps else 0.0
    filled = int(round(frac * width))
    parts = [f"step {step}/{max_steps}", f"[{'#' * filled}{'.' * (width - filled)}]"]
    if last.get("train/loss") is not None:
        parts.append(f"loss {last['train/loss']:.3f}")
    if last.get("eval/loss") is not None:
        parts.append(f"eval {last['eval/loss']:.3f}")
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
    if first is None or now[1] <= first[1] or now[0] <= first[0]:
        return None
    rate = (now[1] - first[1]) / (now[0] - first[0])
    return max(0, max_steps - now[1]) / rate


def render_outages(latest: dict[int, dict[str, Any]]) -> str:
    """`` | no quorum: group 1 for 12s``: groups that cannot reach the lighthouse say so on the console."""
    outages = [f"group {g} for {r['outer/no_quorum_s']:.0f}s" for g, r in latest.items() if r.get("outer/no_quorum_s")]
    return f" | no quorum: {', '.join(outages)}" if outages else ""


@dataclass
class ProgressView:
    """Follows ``metrics/group*.jsonl`` and redraws the slowest group's progress.

    On a terminal the line is redrawn in place; elsewhere (CI, a pipe) a line is printed
    at most every ``plain_interval_s`` so logs stay readable.
    """

    files: list[Path]
    max_steps: int
    out: TextIO = sys.stdout
    plain_interval_s: float = 10.0
    _offsets: dict[Path, int] = field(default_factory=dict)
    _latest: dict[Path, dict[str, Any]] = field(default_factory=dict)
    _last_plain: float = -1e9
    _last_line: str = ""
    _first_progress: tuple[float, int] | None = None  # (elapsed s, slowest group's step) when it was first seen

    def update(self, elapsed_s: float, final: bool = False) -> None:
        for path in self.files:
            records, self._offsets[path] = read_jsonl_tail(path, self._offsets.get(path, 0))
            for record in records:
                self._latest.setdefault(path, {}).update({k: v for k, v in record.items() if v is not None})
        if not self._latest:
            return
        slowest = min(self._latest.values(), key=lambda r: r.get("step", 0))
        step = int(slowest.get("step", 0))
        if self._first_progress is None and step > 0:
            self._first_progress = (elapsed_s, step)
        rates = _present(self._latest.values(), "train/tokens_per_s")
        tflops = _present(self._latest.values(), "train/tflops")
        mfus = _present(self._latest.values(), "train/mfu")
        line = render_progress(
            step,
            self.max_steps,
            elapsed_s,
            slowest,
            eta_s=remaining_seconds(self._first_progress, (elapsed_s, step), self.max_steps),
            job_tokens_per_s=sum(rates) if rates else None,
            job_tflops=sum(tflops) if tflops else None,
            mfu=sum(mfus) / len(mfus) if mfus else None,
        )
        line += render_outages({i: self._latest.get(path, {}) for i, path in enumerate(self.files)})
        tty = self.out.isatty()
        if tty:
            self.out.write("\r" + line + ("\n" if final else ""))
            self.out.flush()
        if line != self._last_line and (final or elapsed_s - self._last_plain >= self.plain_interval_s):
            self._last_plain, self._last_line = elapsed_s, line
            if tty:
                TRANSCRIPT.info(line)  # redrawn in place on the console; one line every interval in run.log
            else:
                say(line, self.out)


def _present(records: Iterable[dict[str, Any]], key: str) -> list[float]:
    """``key``'s latest value in each group's records that has one."""
    return [r[key] for r in records if r.get(key) is not None]
