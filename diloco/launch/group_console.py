"""A multi-host group's terminal: what its leader trains, as the local job's console shows it.

Under ``role=group`` nothing else prints while the group trains (the local launcher's progress
line follows every group's metrics file; on many hosts each group has a terminal of its own). The
leader follows its own group's metrics and commit log on a thread and prints the same lines
(``step 120/500 [...] loss 2.31 ...``, at most every 10 s on a plain console), and at the end one
``done:`` line for the group.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from diloco.config.job import JobConfig
from diloco.launch.progress import ProgressView, say
from diloco.run_paths import RunPaths

REFRESH_S = 1.0  # how often the metrics file is read; a plain console prints at most every 10 s


class GroupConsole:
    """Follows group ``job.group.id``'s metrics in ``paths`` and prints its progress until ``stop``."""

    def __init__(self, job: JobConfig, paths: RunPaths, out: TextIO = sys.stdout) -> None:
        group = job.group.id
        commits = [paths.commits(group)] if job.algo.name != "local" else []
        self.view = ProgressView(
            [paths.metrics(group)], job.trainer.max_steps, out, commits=commits, log_every=job.trainer.log_every
        )
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="group-console", daemon=True)

    def start(self) -> GroupConsole:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * REFRESH_S)

    def finish(self, tokens_per_s: float) -> None:
        """The last line, at the group's average rate (its result's ``tokens_per_s``)."""
        self.stop()
        self.view.finish(time.monotonic() - self._started, tokens_per_s)

    def _follow(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self.view.update(time.monotonic() - self._started)


def group_done_line(report: dict[str, Any], problem: str | None, result_path: str) -> str:
    """``done: group 0 holds the job's final model (round 18, digest 6de5fe9d7c97…); eval loss 1.7587;
    2 heals from a peer; result in RUN/results/group0.json`` (``failed:`` and the reason otherwise)."""
    end = report.get("end") or {}
    digest = (report.get("digest") or "")[:12]
    loss = report.get("final_eval_loss")
    parts = [
        problem or f"group {report['group']} holds the job's final model (round {end.get('round')}, digest {digest}…)"
    ]
    if loss is not None:
        parts.append(f"eval loss {loss:.4f}")
    heals = report.get("recoveries", 0)
    if heals:
        parts.append(f"{heals} heal{'' if heals == 1 else 's'} from a peer")
    parts.append(f"result in {result_path}")
    return f"{'failed' if problem else 'done'}: {'; '.join(parts)}"


def say_done(report: dict[str, Any], problem: str | None, paths: RunPaths) -> None:
    say(group_done_line(report, problem, str(paths.result(report["group"]))), sys.stdout)
