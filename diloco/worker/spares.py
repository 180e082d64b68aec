"""Warm spares: worker sets built ahead of need, each waiting to take a dead group's place.

A spare is ``cluster.workers_per_group`` worker processes started by the local launcher
like a group's (forked or exec'd), which rendezvous among themselves, build the model, its
sharding and the inner optimizer (what every group builds alike), and then block on one
named pipe per rank in the run directory (``RUN/spares/spare<K>_rank<R>.fifo``). Until the
launcher writes a group id there, a spare has not reached the lighthouse: it is never counted
in a quorum, never trains and is never a heal source. Once assigned it becomes that group's
new process set and does what a restarted group does: joins, heals from a live peer, trains.

The pipes are the readiness signal as well: a rank opens its pipe only once it is built, so
the launcher's non-blocking open for writing fails (``ENXIO``) until every rank of the spare
is waiting, and a spare still building is never handed a group. Only the launcher writes
these pipes; what a spare reads is checked JSON, never unpickled.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from diloco.run_paths import RunPaths

ASSIGNMENT_MAX_BYTES = 4096  # PIPE_BUF on Linux: an assignment is written and read whole


class SpareAssignmentError(RuntimeError):
    """What a spare read from its pipe is not an assignment (nothing but the launcher writes there)."""


@dataclass(frozen=True)
class Assignment:
    """The group a spare replaces, and when the launcher handed it over (fault requests
    before then were not meant for it)."""

    group: int
    started_at: float

    def encode(self) -> bytes:
        return json.dumps({"group": self.group, "started_at": self.started_at}).encode() + b"\n"

    @classmethod
    def decode(cls, raw: bytes) -> Assignment:
        try:
            fields = json.loads(raw)
            group, started_at = fields["group"], fields["started_at"]
        except (ValueError, KeyError, TypeError) as error:
            raise SpareAssignmentError(f"not a spare assignment: {raw[:80]!r} ({error})") from None
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            raise SpareAssignmentError(f"not a spare assignment: group {group!r} is not a group id")
        if not isinstance(started_at, (int, float)) or isinstance(started_at, bool):
            raise SpareAssignmentError(f"not a spare assignment: started_at {started_at!r} is not a time")
        return cls(group, float(started_at))


def make_pipes(paths: RunPaths, spare: int, ranks: int) -> list[Path]:
    """Create the spare's pipes (one per rank), before its processes start."""
    pipes = [paths.spare_pipe(spare, rank) for rank in range(ranks)]
    pipes[0].parent.mkdir(parents=True, exist_ok=True)
    for pipe in pipes:
        os.mkfifo(pipe, 0o600)
    return pipes


def wait_for_assignment(pipe: Path) -> Assignment:
    """Block (no polling, no CPU) until the launcher writes this rank's assignment.

    The pipe is opened for reading and writing (Linux: at once, fifo(7)). Holding a write end
    itself, this rank never reads end-of-file, so a launcher that opens the pipe and closes it
    without a word (another rank of this spare was not ready yet) changes nothing, and no
    assignment can be written in a moment when this rank has no read end open (a pipe that
    nobody holds open drops what it buffered).
    """
    if not stat.S_ISFIFO(os.stat(pipe).st_mode):
        raise SpareAssignmentError(f"{pipe} is not the named pipe the launcher made for this spare")
    fd = os.open(pipe, os.O_RDWR)
    try:
        raw = os.read(fd, ASSIGNMENT_MAX_BYTES)  # the launcher writes the assignment in one atomic write
    finally:
        os.close(fd)
    return Assignment.decode(raw)


def assign(pipes: list[Path], assignment: Assignment) -> bool:
    """Hand ``assignment`` to every rank of a spare, if every rank is built and waiting; True if done.

    Never blocks: a rank that is still building has no reader on its pipe, which fails the
    non-blocking open (``ENXIO``); then the pipes opened so far are closed unwritten (their
    readers wait again) and nothing is assigned.
    """
    fds = []
    try:
        for pipe in pipes:
            try:
                fds.append(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as error:
                if error.errno in (errno.ENXIO, errno.ENOENT):
                    return False
                raise
        message = assignment.encode()
        for fd in fds:
            os.write(fd, message)  # shorter than PIPE_BUF: one atomic write to a pipe with room
        return True
    except BrokenPipeError:  # a rank died since its open: the caller finds the spare dead and replaces it
        return False
    finally:
        for fd in fds:
            os.close(fd)
