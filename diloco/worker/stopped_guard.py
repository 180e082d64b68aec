"""Under torchrun, a group with a worker stopped for good fails fast, so the agent restarts it.

torch's elastic agent restarts a group when one of its workers exits, but a stopped worker
(SIGSTOP, SIGTSTP) never exits: its peers block in collectives until
``cluster.timeouts.collective`` and then crash (which the agent does notice), and a group whose
workers are all stopped (a group of one, say) holds its place until the job's end. So the
leader of a group under torchrun starts this guard beside the workers, as a process of its own
(a stopped process's threads stop with it). Every ``POLL_S`` it reads the state of each worker
of the agent in ``/proc`` and SIGKILLs one stopped past ``cluster.timeouts.stopped``
(``diloco.stopped_watch``); the agent sees a worker die, stops the others and starts the group
again, and the new workers heal from a peer.

The guard leaves when the leader that started it does (finished, crashed, killed, or gone with
its agent: ``lifeline.die_with_parent``); a restarted group's new leader starts a new guard.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from diloco.stopped_watch import StoppedWatch, stat_fields

POLL_S = 1.0


def children_of(parent: int) -> list[int]:
    """Every process whose parent is ``parent`` (a scan of ``/proc``)."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [pid for pid in pids if (fields := stat_fields(pid)) and int(fields[1]) == parent]  # None: gone meanwhile


def start_guard(stopped_limit_s: float) -> subprocess.Popen:
    """Called by the group's leader (local rank 0) under torchrun: watch the agent's workers."""
    argv = ["--agent", str(os.getppid()), "--leader", str(os.getpid()), "--stopped", f"{stopped_limit_s:g}"]
    return subprocess.Popen([sys.executable, "-m", "diloco.worker.stopped_guard", *argv])


def guard(
    agent: int,
    leader: int,
    stopped_limit_s: float,
    *,
    workers: Callable[[int], list[int]] = children_of,
    watch: StoppedWatch | None = None,
    poll_s: float = POLL_S,
    parent: Callable[[], int] = os.getppid,
) -> int | None:
    """Watch ``agent``'s workers until one stays stopped past ``stopped_limit_s`` (killed; its pid
    returned) or ``leader`` is no longer this process's parent (None)."""
    watch = watch or StoppedWatch()
    while parent() == leader:
        stopped = watch.stopped_for(workers(agent), time.monotonic())
        if stopped is not None and stopped[1] >= stopped_limit_s:
            pid, stopped_s = stopped
            print(
                f"stopped guard: worker pid {pid} stopped for {stopped_s:.0f}s "
                f"(cluster.timeouts.stopped={stopped_limit_s:g}); killing it so torchrun restarts the group",
                file=sys.stderr,
                flush=True,
            )
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(poll_s)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agent", type=int, required=True, help="pid of the torchrun agent whose workers to watch")
    parser.add_argument("--leader", type=int, required=True, help="pid of the group's leader: leave when it is gone")
    parser.add_argument("--stopped", type=float, required=True, help="cluster.timeouts.stopped, seconds")
    args = parser.parse_args(argv)
    guard(args.agent, args.leader, args.stopped)


if __name__ == "__main__":
    main()
