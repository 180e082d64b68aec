"""Run a call that might hang on a daemon thread, so a test fails instead of waiting forever."""

from __future__ import annotations

import threading
from collections.abc import Callable


def in_thread(call: Callable[[], object]) -> Callable[..., object]:
    """Start ``call`` in a thread; the function returned waits for it and gives what it returned,
    or the exception it raised. Its ``guard_s`` is a hang guard, not a time bound: a call still
    running then fails the test instead of hanging it."""
    box: list = []

    def run() -> None:
        try:
            box.append(call())
        except Exception as e:  # noqa: BLE001 (the test inspects it)
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(guard_s: float = 60.0) -> object:
        thread.join(guard_s)
        assert not thread.is_alive(), f"the call did not return within the {guard_s:g} s hang guard"
        return box[0]

    return result


def guarded(call: Callable[[], object], guard_s: float) -> object:
    """``call()``'s value or exception, failing the test if it has not returned within ``guard_s``."""
    return in_thread(call)(guard_s)
