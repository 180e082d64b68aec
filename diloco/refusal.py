"""A group refused for a cause its next start would meet again: said once, and not restarted.

torchrun starts a group again whenever one of its workers exits non-zero, whatever the code,
and exits 1 itself once ``--max-restarts`` are spent: a wrong lighthouse address, a missing
corpus or a configuration the lighthouse refuses would be met again on every try (80 s each,
a model built every time). So a refused group's leader writes its one line to
``RUN_DIR/refused/group<k>.txt``, which an orchestrator reads before it starts the group
again (``experiments/fault_tolerance/multihost.sbatch`` does), and under torchrun stops its own agent
(SIGTERM: the agent stops the group's other workers and exits without a restart). Every
worker exits ``REFUSED_EXIT_CODE``. docs/fault-tolerance.md ("Exit codes") says what to
restart.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from typing import NoReturn

from diloco.exits import REFUSED_EXIT_CODE, exit_without_teardown
from diloco.files import write_text_atomically
from diloco.run_paths import RunPaths


def refuse_group(message: str, paths: RunPaths | None, group: int | None, environ: Mapping[str, str]) -> NoReturn:
    """Exit ``REFUSED_EXIT_CODE`` with ``message`` (one line); under torchrun the leader records it
    (for a known ``group`` with a run directory) and stops the agent so it starts nothing again."""
    print(message, file=sys.stderr, flush=True)
    # Without an agent the exit code reaches whoever started the worker, and nothing is written.
    if environ.get("TORCHELASTIC_RUN_ID") and environ.get("LOCAL_RANK", "0") == "0":  # each host's agent
        if paths is not None and group is not None:
            try:
                write_text_atomically(paths.refusal(group), message + "\n")
            except OSError:  # a run directory it cannot write: the line above still says why
                pass
        os.kill(os.getppid(), signal.SIGTERM)
    exit_without_teardown(REFUSED_EXIT_CODE)


def clear_refusal(paths: RunPaths, group: int) -> None:
    """A group started again (its configuration fixed, say) is no longer refused until it is again."""
    paths.refusal(group).unlink(missing_ok=True)
