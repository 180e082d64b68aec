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
from diloco.ft.protocol import LighthouseRefused, LighthouseUnavailable, RoundNews

log = logging.getLogger(__name__)


class LaneWatcher(Poller):
    """One long poll at a time, held across the rounds this worker takes part in (see the module
    docstring): the lighthouse answers it when a member leaves the group's latest round, or after
    ``poll_s``, not when the group moves on to its next round."""

    thread_name = "lane-watch"

    def __init__(self, client: LighthouseClient, poll_s: float) -> None:
        super().__init__(client, poll_s)
        self._round: tuple[int, LaneCancel] | None = None
        self._news = RoundNews()  # the latest news, of the followed round or of the one granted next
        self._told = 0  # members gone from the followed round that its cancel was given

    def follow(self, round_id: int, cancel: LaneCancel) -> None:
        """Watch round ``round_id`` (``Quorum.round_id``) from now on; set ``cancel`` as members leave it."""
        with self._lock:
            self._round = (round_id, cancel)
            self._told = 0
            if self._news.round_id != round_id:  # news of an earlier round, or of a restarted lighthouse's
                self._news = RoundNews(round_id)
            self._tell_locked()
        self._moved.set()

    def _loop(self) -> None:
        self._moved.wait()  # the first round
        while not self._stop.is_set():
            self._moved.clear()
            with self._lock:
                assert self._round is not None
                round_id = self._round[0]
                ahead = self._news.round_id > round_id
                gone_seen = len(self._news.gone)
            if ahead:  # the next round broke before its grant reached this worker: wait until it follows it
                self._moved.wait(self.poll_s)
                continue
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
            with self._lock:
                newer = (news.round_id, len(news.gone)) > (self._news.round_id, len(self._news.gone))
                if newer:
                    self._news = news
                    self._tell_locked()
            if not newer and news.round_id != round_id:  # of a round a restarted lighthouse granted, not followed yet
                self._moved.wait(RETRY_S)

    def _tell_locked(self) -> None:
        """Give the followed round's cancel the members that left it since it was last told."""
        assert self._round is not None
        round_id, cancel = self._round
        news = self._news
        if news.round_id != round_id or len(news.gone) <= self._told:
            return
        self._told = len(news.gone)
        mine = self.client.group in news.gone  # this group was dropped: it gives up everything
        what = "the whole round (it was dropped)" if mine else f"what waits on {', '.join(news.gone)}"
        log.warning("group %s: %s; giving up %s", self.client.group, news.broken, what)
        cancel.set(news.broken, None if mine else frozenset(news.gone))
