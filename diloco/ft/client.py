"""A group's side of the lighthouse over HTTP/JSON: the leader's heartbeats, long-poll quorum
(and round) requests and commits; every worker's lane watch.

It speaks only ``protocol``'s typed messages, so it needs nothing of the server module; an
error answer becomes the exception its code names (``ErrorAnswer.exception``). Requests go
over kept-alive connections (``keep_alive``), each still bounded by its own timeout.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from typing import Any

from diloco.config.base import check
from diloco.ft.identity import config_digest
from diloco.ft.keep_alive import Answer, ConnectionPool
from diloco.ft.protocol import (
    ErrorAnswer,
    ErrorCode,
    GroupMessage,
    GroupProgress,
    Heartbeat,
    LaneWatch,
    LighthouseRefused,
    LighthouseUnavailable,
    QuorumAsk,
    QuorumGrant,
    RecoveryNotice,
    RoundCommit,
    RoundNews,
    RoundWatch,
    SignOfLife,
    authorization_header,
    probe_request_from_json,
    quorum_answer_from_json,
    round_open_from_json,
)
from diloco.ft.quorum import JobEnd, Quorum


class LighthouseClient:
    """A group's side. Thread-safe: heartbeat from one thread while another long-polls."""

    def __init__(
        self,
        url: str,
        *,
        token: str,
        job_id: str,
        signature: str,
        group: str,
        connect_timeout_s: float,
        config: dict[str, Any] | None = None,
    ) -> None:
        check(connect_timeout_s > 0, "cluster.timeouts.connect", connect_timeout_s, "must be > 0 seconds")
        self.url = url.rstrip("/")
        self.token = token
        self.job_id = job_id
        self.signature = signature
        self.group = group
        self.connect_timeout_s = connect_timeout_s
        self.config = config or {}  # the group's flat training configuration; the lighthouse compares it
        self._config_digest = config_digest(self.config) if self.config else ""  # sent alone once granted
        self._last_quorum_id = 0  # sent with quorum requests, so a restarted lighthouse never reuses an id
        self._held: Quorum | None = None  # the last quorum granted: a grant of its id leaves out its participants
        self._lock = threading.Lock()  # the id is updated by a heartbeat thread and the long poll alike
        self._connections = ConnectionPool(self.url)  # direct, never through a proxy from the environment
        self._signed_at = -math.inf  # when the last sign of life went out (``beat_due_in``); -inf: none that arrived

    def heartbeat(
        self,
        step: int,
        quorum_id: int,
        finished: bool = False,
        progress: GroupProgress | None = None,
        reach: dict[str, Any] | None = None,
    ) -> dict[str, str]:
        """A sign of life (``reach``: the leader's ``ReachReport``); the peers the lighthouse asks it to probe again."""
        self._seen(quorum_id)
        beat = Heartbeat(
            self.job_id,
            self.signature,
            self.group,
            step=step,
            quorum_id=quorum_id,
            finished=finished,
            progress=_progress_json(progress),
            reach=reach or {},
        )
        try:
            return probe_request_from_json(self._post(beat, self.connect_timeout_s))
        except ValueError as e:
            raise LighthouseUnavailable(f"lighthouse at {self.url}: {e}") from None

    def beat_due_in(self, interval_s: float) -> float:
        """Seconds until the next heartbeat is due, ``interval_s`` after the last sign of life went out.

        The lighthouse takes a quorum ask or a commit as a heartbeat too, so the beat due just after
        one need not be sent: an eighth fewer heartbeats at 1,000 groups, fewer amid a round's asks.
        A request that failed or was refused counts for nothing: the next beat is due at once.
        """
        return self._signed_at + interval_s - time.monotonic()

    def quorum(
        self,
        step: int,
        commit_failed: bool,
        timeout_s: float,
        *,
        round_step: int = 0,
        finished: bool = False,
        digest: str = "",
        lane_failed: bool = False,
        progress: GroupProgress | None = None,
        reach: dict[str, Any] | None = None,
    ) -> QuorumGrant | JobEnd:
        """Block (at most timeout_s + connect_timeout_s) until a quorum containing this group forms.

        ``round_step`` is the inner step the group asks at (see ``QuorumRequest``). A
        ``finished`` group (``digest``: its global state's) may instead learn that the job ended.
        ``lane_failed``: its last round failed on the lane itself (see ``QuorumRequest``).
        ``progress``: for the status page, as a heartbeat's (``SignOfLife``); ``reach``: as a heartbeat's.
        """
        check(timeout_s > 0, "cluster.timeouts.quorum", timeout_s, "must be > 0 seconds")
        ask = QuorumAsk(
            self.job_id,
            self.signature,
            self.group,
            step=step,
            round_step=round_step,
            commit_failed=commit_failed,
            lane_failed=lane_failed,
            timeout_s=timeout_s,
            quorum_id=self._seen(0),
            finished=finished,
            digest=digest,
            config=self.config if self._held is None else {},
            known_quorum=0 if self._held is None else self._held.quorum_id,
            config_digest=self._config_digest,
            progress=_progress_json(progress),
            reach=reach or {},
        )
        try:
            answer = quorum_answer_from_json(self._post(ask, timeout_s + self.connect_timeout_s), self._held)
        except ValueError as e:
            raise LighthouseUnavailable(f"lighthouse at {self.url}: {e}") from None
        if isinstance(answer, JobEnd):
            return answer
        if self.group not in answer.quorum.participants:
            raise LighthouseUnavailable(f"quorum {answer.quorum.quorum_id} from {self.url} lacks group {self.group!r}")
        self._seen(answer.quorum.quorum_id)
        self._held = answer.quorum
        return answer

    def round_open(self, step: int, round_step: int, timeout_s: float) -> int:
        """Block (at most timeout_s + connect_timeout_s) until a peer opens a round past
        ``(step, round_step)``; its inner step, or 0 if none did in time."""
        watch = RoundWatch(
            self.job_id, self.signature, self.group, step=step, round_step=round_step, timeout_s=timeout_s
        )
        try:
            return round_open_from_json(self._post(watch, timeout_s + self.connect_timeout_s))
        except ValueError as e:
            raise LighthouseUnavailable(f"lighthouse at {self.url}: {e}") from None

    def lane_watch(self, round_id: int, timeout_s: float, gone_seen: int = 0) -> RoundNews:
        """Block (at most timeout_s + connect_timeout_s) until more than ``gone_seen`` members left
        round ``round_id``, or any left a round granted to this group later (``LaneWatch``)."""
        watch = LaneWatch(
            self.job_id, self.signature, self.group, round_id=round_id, timeout_s=timeout_s, gone_seen=gone_seen
        )
        try:
            return RoundNews.from_json(self._post(watch, timeout_s + self.connect_timeout_s))
        except ValueError as e:
            raise LighthouseUnavailable(f"lighthouse at {self.url}: {e}") from None

    def commit(self, round_id: int, step: int, progress: GroupProgress | None = None) -> str:
        """Ask to commit round ``round_id`` (the group then stands at ``step``): "" if it may, else why not.
        ``progress``: for the status page, as a heartbeat's (``SignOfLife``)."""
        commit = RoundCommit(
            self.job_id, self.signature, self.group, round_id=round_id, step=step, progress=_progress_json(progress)
        )
        try:
            return RoundNews.from_json(self._post(commit, self.connect_timeout_s)).broken
        except ValueError as e:
            raise LighthouseUnavailable(f"lighthouse at {self.url}: {e}") from None

    def recovery(self, wait_ms: int) -> None:
        """Say this (dead) group is being replaced: rounds wait ``wait_ms`` for it, or (0) go on without it."""
        self._post(RecoveryNotice(self.job_id, self.signature, self.group, wait_ms=wait_ms), self.connect_timeout_s)

    def _seen(self, quorum_id: int) -> int:
        with self._lock:
            self._last_quorum_id = max(self._last_quorum_id, quorum_id)
            return self._last_quorum_id

    def _post(self, message: GroupMessage, timeout_s: float) -> Any:
        """The decoded JSON of a 200 answer; an error answer raises the exception its code names."""
        path = message.path
        headers = {"Content-Type": "application/json", **authorization_header(self.token)}
        body = json.dumps(message.to_json()).encode()
        signs_life = isinstance(message, SignOfLife)
        if signs_life:
            self._signed_at = time.monotonic()
        try:
            answer = self._connections.post(path, body, headers, timeout_s)
            if answer.status == 200:
                return json.loads(answer.body)
            error = self._error(path, answer)
        except (OSError, http.client.HTTPException, ValueError) as e:
            error = LighthouseUnavailable(f"lighthouse at {self.url} unreachable for {path}: {e!r}")
        if signs_life:
            self._signed_at = -math.inf  # it did not arrive, or was refused: no sign of life
        raise error from None

    def _error(self, path: str, got: Answer) -> Exception:
        """The exception for an error answer, by its code. An answer without one is not the
        lighthouse's: a 4xx there is refused (asking again reaches the same wrong server: fix
        cluster.lighthouse.host/port), anything else is a proxy or server failing, worth retrying."""
        try:
            answer = ErrorAnswer.from_json(json.loads(got.body))
        except ValueError as bad:
            code = f"HTTP {got.status} {got.reason}"
            message = f"{self.url} answered {code} to {path} without a lighthouse error code ({bad})"
            if 400 <= got.status < 500:
                return LighthouseRefused(ErrorCode.NOT_FOUND, f"{message}: is the lighthouse at this address?")
            return LighthouseUnavailable(message)
        error = answer.exception()
        if isinstance(error, LighthouseUnavailable):
            return LighthouseUnavailable(f"lighthouse at {self.url} answered {got.status} to {path}: {error}")
        return error


def _progress_json(progress: GroupProgress | None) -> dict[str, Any]:
    return {} if progress is None else progress.to_json()
