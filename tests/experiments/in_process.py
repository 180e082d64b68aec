"""Run an experiment script's main() in the test's own process: the smoke tests' runner.

A fresh ``python -m experiments.<area>.<script>`` pays its imports (torch, hydra: ~5 s on a loaded
two-core machine) on every smoke test; main() here finds them loaded. What the script does is
the same: its argv, its jobs (launched as the library's own tests launch theirs), its exit
status and its output, which the test reads as it would a subprocess's.
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Any

import pytest


class ScriptTimeout(BaseException):
    """A BaseException, not an Exception: nothing on the way swallows it, and the script's
    with-blocks still unwind and stop every process of its job, as on the SIGTERM of a subprocess."""


def run_main(script: str, args: list[str], timeout_s: int, capsys: Any) -> tuple[str, str]:
    """The main() of ``script``, a module path (``experiments.scale.bench_model_size``), with ``args``
    as its command line; its (stdout, stderr), the test failing if it exits with an error or outlasts ``timeout_s`` (SIGALRM)."""
    module = importlib.import_module(script)
    kept = {s: signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT)}
    argv = sys.argv

    def expire(signum: int, frame: Any) -> None:
        raise ScriptTimeout(f"{script} took over {timeout_s}s")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(timeout_s)
    sys.argv = [script, *args]
    try:
        module.main()
    except SystemExit as exited:
        if exited.code not in (None, 0):
            out, err = capsys.readouterr()
            pytest.fail(f"{script} failed: {exited.code}\n{out}\n{err[-12000:]}")
    finally:
        signal.alarm(0)
        sys.argv = argv
        for signum, handler in kept.items():  # stop_on_sigterm() must not outlive the script
            signal.signal(signum, handler)
    return capsys.readouterr()
