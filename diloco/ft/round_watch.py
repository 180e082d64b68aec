"""Time-bounded windows: a group leader learns, in the background, the round its peers opened.

A slower group keeps training while a long poll (``RoundWatch``) waits at the lighthouse for
a peer to ask for a quorum past this group's last round; the training thread then reads the
round's inner step between two inner steps and decides whether to skip to it. Nothing here
waits on the training thread, and nothing it does waits on the network.
"""

from __future__ import annotations

import logging

from diloco.ft.client import LighthouseClient
from diloco.ft.poller import RETRY_S, Poller
from diloco.ft.protocol import LighthouseRefused, LighthouseUnavailable

log = logging.getLogger(__name__)


class RoundWatcher(Poller):
    """One long poll at a time for the round opened past the group's position (committed, last round step)."""

    thread_name = "round-watch"

    def __init__(self, client: LighthouseClient, poll_s: float) -> None:
        super().__init__(client, poll_s)
        self._position = (0, 0)
        self._open_step = 0

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
