"""Time-bounded windows: a group leader learns, in the background, the round its peers opened.

A slower group keeps training while a long poll (``RoundWatch``) waits at the lighthouse for
a peer to ask for a quorum past this group's last round; the training thread then reads the
round's inner step between two inner steps and decides whether to skip to it. Nothing here
waits on the training thread, and nothing it does waits on the network.
"""

from __future__ import annotations

import logging
import threading

from diloco.ft.client import LighthouseClient
from diloco.ft.protocol import LighthouseRefused, LighthouseUnavailable

log = logging.getLogger(__name__)

RETRY_S = 1.0  # between polls while the lighthouse cannot be reached


class RoundWatcher:
    """One long poll at a time for the round opened past the group's position (committed, last round step)."""

    def __init__(self, client: LighthouseClient, poll_s: float) -> None:
        self.client = client
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._position = (0, 0)
        self._open_step = 0
        self._moved = threading.Event()  # the group started a round or committed: poll again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="round-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling; an open poll is abandoned (its thread is a daemon bounded by ``poll_s``)."""
        self._stop.set()
        self._moved.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    @property
    def open_step(self) -> int:
        """The inner step of the round a peer opened past our position (0: none known)."""
        with self._lock:
            return self._open_step

    def moved(self, committed: int, round_step: int) -> None:
        """The group's position changed: what was open before is no longer news."""
        with self._lock:
            self._position = (committed, round_step)
            self._open_step = 0
        self._moved.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._moved.clear()
            with self._lock:
                position = self._position
            try:
                step = self.client.round_open(*position, timeout_s=self.poll_s)
            except LighthouseRefused as error:  # the heartbeats report the refusal to the group
                log.debug("round watch refused: %s", error)
                return
            except LighthouseUnavailable as error:
                log.debug("round watch failed (%s); retrying", error)
                self._stop.wait(RETRY_S)
                continue
            if step:
                with self._lock:
                    if self._position == position:
                        self._open_step = step
                self._moved.wait()  # the next poll would answer the same round at once
