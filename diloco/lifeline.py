"""Every process of a local job dies with its launcher, however the launcher ends.

The launcher holds the only write end of a pipe; every other process of the job (the
lighthouse, the fork server, each worker) gets the read end's number as ``--lifeline-fd``
and watches it. When the launcher is gone (it returned, crashed or was SIGKILLed: the
kernel closes its descriptors in every case) a read of the pipe returns EOF and the
watcher SIGKILLs its own process. No polling, no environment variable, no clean-up code
that a SIGKILL would skip.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

ARGUMENT = "--lifeline-fd"


class Lifeline:
    """The launcher's side: a pipe whose write end no other process holds.

    ``os.pipe`` makes both ends non-inheritable (PEP 446) and ``subprocess`` closes every
    other descriptor, so only the read end, handed on with ``Popen(pass_fds=...)``,
    reaches the children. A launcher that ``os.fork``s by other means would leak the write
    end into that child and keep the job alive as long as the child lives.
    """

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()

    def argv(self) -> list[str]:
        """The arguments that hand the read end to a child (with ``pass_fds=(self.read_fd,)``)."""
        return [ARGUMENT, str(self.read_fd)]

    def cut(self) -> None:
        """Close the pipe: every process still watching it kills itself at once."""
        os.close(self._write_fd)
        os.close(self.read_fd)


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        ARGUMENT,
        type=int,
        default=None,
        metavar="FD",
        help="read end of the launcher's lifeline pipe: this process dies when the launcher is gone",
    )


def watch(fd: int) -> None:
    """Kill this process as soon as the launcher holding the pipe's write end is gone."""
    threading.Thread(target=_die_at_eof, args=(fd,), name="lifeline", daemon=True).start()


def _die_at_eof(fd: int) -> None:
    try:
        while os.read(fd, 1):
            pass  # the launcher never writes: only EOF means something
    except OSError as error:  # a closed or foreign descriptor: nothing would ever stop this process
        _die(f"lifeline fd {fd} is unreadable ({error}), as if the launcher were gone")
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(poll_s: float = 1.0) -> None:
    """Kill this process within ``poll_s`` of its parent's end (it is re-parented then).

    For a worker under torchrun, whose agent holds no pipe for it: an agent killed alone would
    otherwise leave its workers training on, and the agent started again in its place would run
    a second copy of the group beside them. One orphaned before this call (init adopted it) dies at
    once; under another subreaper it fails instead at its group's store, which its agent served.
    """
    parent = os.getppid()
    if parent == 1:
        _die(f"parent is gone before {os.getpid()} started watching it")
    threading.Thread(target=_die_when_orphaned, args=(parent, poll_s), name="parent watch", daemon=True).start()


def _die_when_orphaned(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _die(f"parent {parent} is gone")


def _die(why: str) -> None:
    print(f"{why}: stopping", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
