"""How a worker's process ends: the exit codes the launcher reads, and an exit without teardown.

Shared by the worker, the launcher's supervisor and ``run.py``, so the supervisor reads an exit
code without loading the worker.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

# A worker refused because the job had ended exits with this: too late, not crashed.
JOB_ENDED_EXIT_CODE = 3
# A worker that stopped because it was asked to (SIGTERM, SIGINT) before the end: not finished, not crashed.
INTERRUPTED_EXIT_CODE = 4
# A worker that refused the job's configuration (a ConfigError only it could raise: a checkpoint's tensors
# of another job, say): a restart would be refused alike, so the job fails at once with its one line.
REFUSED_EXIT_CODE = 5
REFUSED_PREFIX = "error: "  # what starts the refusal's line on the worker's stderr


def exit_without_teardown(code: int = 0, message: str | None = None) -> NoReturn:
    """Leave without running C++ destructors: everything is written and every group torn down.

    Destroying aborted Gloo lanes and store clients at interpreter exit intermittently ends
    in std::terminate, which would turn a finished worker into a crashed one. ``message``
    goes to stderr first (the one-line reason of a non-zero ``code``).
    """
    if message:
        print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
