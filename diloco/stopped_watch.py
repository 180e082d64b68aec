"""Which workers are stopped, and for how long.

A group with a stopped worker (SIGSTOP, SIGTSTP) cannot go on, but nothing in it
fails: its workers are alive to ``poll()``, the lighthouse drops it after a heartbeat timeout,
and when every worker of the group is stopped no collective inside it ever times out. The
others train to the end without it, and the job then fails for want of its result. So whoever
restarts the group looks at each worker's state in ``/proc`` and treats a worker stopped past
``cluster.timeouts.stopped`` as a crashed one: the local launcher kills its group and restarts it
(``diloco.launch.supervisor``); under torchrun the group's guard kills the worker and the agent
restarts the group (``diloco.worker.stopped_guard``). The new workers heal from a peer.

Only a job-control stop counts (state ``T``), not a tracing stop (``t``: a debugger attached
on purpose).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

JOB_CONTROL_STOP = "T"


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...); None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, T stopped, Z zombie, ...); None if it is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


class StoppedWatch:
    """Since when each process has been seen stopped at every look (``now`` from the caller's clock):
    a process seen running once since starts again from zero."""

    def __init__(self, state: Callable[[int], str | None] = process_state) -> None:
        self._state = state
        self._stopped_since: dict[int, float] = {}

    def stopped_for(self, pids: Iterable[int], now: float) -> tuple[int, float] | None:
        """The longest-stopped of ``pids`` and for how long it has been, or None if none is stopped now."""
        longest = None
        for pid in pids:
            if self._state(pid) != JOB_CONTROL_STOP:
                self._stopped_since.pop(pid, None)
                continue
            stopped_s = now - self._stopped_since.setdefault(pid, now)
            if longest is None or stopped_s > longest[1]:
                longest = (pid, stopped_s)
        return longest

    def forget(self, pids: Iterable[int]) -> None:
        """These processes are gone (killed): their pids may come back for other processes."""
        for pid in pids:
            self._stopped_since.pop(pid, None)
