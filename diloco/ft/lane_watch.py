"""A hung peer ends the round in seconds: every worker learns from the lighthouse, in the
background, that the round its lane serves lost a member, and cancels its waits on the lane.

The lighthouse drops a member that sent no heartbeat for ``timeouts.heartbeat`` (or that the
launcher saw die) and marks its open round broken (``QuorumBook.break_rounds``). Without
this watch a survivor's all-reduce or heal with a SIGSTOPped peer waits for the whole
``timeouts.collective``. Every rank watches (not only the leader that heartbeats), as each
rank waits on its own lane. Nothing here waits on the training thread.
"""

from __future__ import annotations

import logging

from diloco.ft.client import LighthouseClient
from diloco.ft.lanes import LaneCancel
from diloco.ft.poller import RETRY_S, Poller
from diloco.ft.protocol import LighthouseRefused, LighthouseUnavailable

log = logging.getLogger(__name__)


class LaneWatcher(Poller):
    """One long poll at a time for the round this worker takes part in (see the module docstring)."""

    thread_name = "lane-watch"

    def __init__(self, client: LighthouseClient, poll_s: float) -> None:
        super().__init__(client, poll_s)
        self._round: tuple[int, LaneCancel] | None = None

    def follow(self, round_id: int, cancel: LaneCancel) -> None:
        """Watch round ``round_id`` (``Quorum.round_id``) from now on; set ``cancel`` as members leave it."""
        with self._lock:
            self._round = (round_id, cancel)
        self._moved.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._moved.wait()
            self._moved.clear()
            with self._lock:
                watched = self._round
            if watched is not None:
                self._watch(*watched)

    def _watch(self, round_id: int, cancel: LaneCancel) -> None:
        """Poll until this group leaves the round (or another is followed), cancelling as members leave it."""
        gone_seen = 0
        while not self._stop.is_set() and not self._moved.is_set():
            try:
                news = self.client.lane_watch(round_id, timeout_s=self.poll_s, gone_seen=gone_seen)
            except LighthouseRefused as error:  # the leader's heartbeats report the refusal
                log.debug("lane watch refused: %s", error)
                self._stop.set()
                return
            except LighthouseUnavailable as error:
                log.debug("lane watch failed (%s); retrying", error)
                self._stop.wait(RETRY_S)
                continue
            if len(news.gone) > gone_seen:
                gone_seen = len(news.gone)
                log.warning(
                    "group %s: %s; giving up what waits on %s", self.client.group, news.broken, ", ".join(news.gone)
                )
                mine = self.client.group in news.gone  # this group was dropped: it gives up everything
                cancel.set(news.broken, None if mine else frozenset(news.gone))
            if not news.open:
                return
