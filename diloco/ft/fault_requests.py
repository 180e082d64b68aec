"""Faults asked of a group's workers: the launcher appends a request to the group's file, the
workers' ``FaultHook`` picks it up at their next round (docs/fault-tolerance.md, "Injecting faults").

Here, below the synchronizers that inject them and the launcher that asks for them, so neither
imports the other.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from diloco.files import append_text

log = logging.getLogger(__name__)

INJECTABLE_FAULTS = ("fail_round", "break_lane", "nan", "stop_in_round")  # what a request may ask of a worker


def request_fault(path: Path, fault: str) -> None:
    """Queue a fault for a group: one line, one write; its workers pick it up at their next round."""
    path.parent.mkdir(parents=True, exist_ok=True)
    append_text(path, f"{fault} {time.time()}\n")


class FaultHook:
    """The faults requested for one group, injected by its synchronizer at the next round they apply to.

    ``fail_round``: this worker's all-reduce is treated as failed after it completes (the
    peers commit, this group does not and heals next round). ``break_lane``: the lane is
    aborted while the all-reduce is in flight (nobody commits that round). ``nan``: this
    group's update becomes non-finite (the guard leaves it out; it heals). ``stop_in_round``:
    this worker SIGSTOPs itself with its all-reduce in flight, a hung peer exactly where it
    hurts most (whoever asked sends it SIGCONT).

    Composed in by the worker only when the job injects faults into workers: without a hook
    the synchronizer reads no file. Every worker of the group reads the same request file,
    polled at the start of each round rather than signalled, so a request can never reach a
    process before it is ready for it. Requests older than ``since`` (when this process of
    the group was started) targeted an earlier process, before a restart.
    """

    def __init__(self, path: Path, *, since: float, group: str) -> None:
        self.path = path
        self.since = since
        self.group = group
        self._seen = 0
        self._pending: set[str] = set()

    def poll(self) -> None:
        """At the start of a round: queue the faults requested since the last poll."""
        lines = self._lines()
        new, self._seen = lines[self._seen :], len(lines)
        for fault, at in (line.split() for line in new):
            if float(at) >= self.since:
                self.inject(fault)

    def inject(self, fault: str) -> None:
        """Queue ``fault`` for the next round it applies to."""
        if fault not in INJECTABLE_FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {', '.join(INJECTABLE_FAULTS)}")
        self._pending.add(fault)

    def take(self, fault: str) -> bool:
        """True once per queued ``fault``: the round asking injects it now."""
        if fault not in self._pending:
            return False
        self._pending.discard(fault)
        log.warning("group %s: injected fault %s", self.group, fault)
        return True

    def _lines(self) -> list[str]:
        try:
            return [line for line in self.path.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []
