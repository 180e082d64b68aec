"""A blocking constructor run on a helper thread that its caller may walk away from.

A lane's Gloo rendezvous (``ProcessGroupGloo``'s constructor) blocks until every member has
published its address in the store and connected, up to ``cluster.timeouts.connect`` and
then the collective timeout, and nothing interrupts it. A peer that hangs (SIGSTOP) just as a
new lane forms would hold the survivors that long, where a hang mid all-reduce costs them a
heartbeat timeout (``lane_watch``). So the constructor runs on a daemon thread and the caller
waits for it or for its give-up signal, whichever comes first.

An abandoned constructor still ends by its own timeouts; what it builds after all is handed to
``discard`` on its thread and never returned, so nothing uses it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.02  # how often the wait looks at its give-up signal (completion wakes it at once)


def abandonable(
    build: Callable[[], T], give_up: Callable[[], bool], timeout_s: float, discard: Callable[[T], None], name: str
) -> T | None:
    """``build()``'s result, or None once ``give_up()`` holds or ``timeout_s`` passed first.

    An exception ``build`` raises in time is raised here. After None, ``build`` goes on alone
    on its thread; a result it produces later goes to ``discard``, an exception is dropped.
    """
    lock = threading.Lock()
    done = threading.Event()
    outcome: dict[str, object] = {}  # "value" or "error", or "abandoned" once the caller left

    def run() -> None:
        try:
            value = build()
        except Exception as error:  # re-raised by the caller if it is still waiting
            with lock:
                outcome["error"] = error
                done.set()
            return
        with lock:
            late = "abandoned" in outcome
            if not late:
                outcome["value"] = value
            done.set()
        if late:
            discard(value)

    threading.Thread(target=run, name=name, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(POLL_S):
        if give_up() or time.monotonic() >= deadline:
            with lock:
                if not done.is_set():
                    outcome["abandoned"] = True
                    return None
            break
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
