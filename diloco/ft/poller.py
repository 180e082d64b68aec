"""What the round watch and the lane watch share: a daemon thread that long-polls the lighthouse
for a group, woken when the group moves on, so that the training thread never waits on it."""

from __future__ import annotations

import threading

from diloco.ft.client import LighthouseClient

RETRY_S = 1.0  # between polls while the lighthouse cannot be reached


class Poller:
    """``_loop`` runs on the thread; ``_moved`` tells it there is something new to poll about."""

    thread_name = "poller"

    def __init__(self, client: LighthouseClient, poll_s: float) -> None:
        self.client = client
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._moved = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling; an open poll is abandoned (its thread is a daemon bounded by ``poll_s``)."""
        self._stop.set()
        self._moved.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _loop(self) -> None:
        raise NotImplementedError
