"""A group leader's side of the lighthouse: heartbeats and long-poll quorum requests over HTTP/JSON."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
from typing import Any

from diloco.config_base import check
from diloco.ft.protocol import LighthouseRefused, LighthouseUnavailable, QuorumTimeout
from diloco.ft.quorum import JobEnd, Quorum

Granted = tuple[Quorum, tuple[str, int]]  # a quorum containing this group, and the store its lanes meet on


class LighthouseClient:
    """A group leader's side. Thread-safe: heartbeat from one thread while another long-polls."""

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
        self._last_quorum_id = 0  # sent with quorum requests, so a restarted lighthouse never reuses an id
        self._lock = threading.Lock()  # the id is updated by a heartbeat thread and the long poll alike
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy from the env

    def heartbeat(self, step: int, quorum_id: int, finished: bool = False) -> None:
        self._seen(quorum_id)
        self._post("/heartbeat", {"step": step, "quorum_id": quorum_id, "finished": finished}, self.connect_timeout_s)

    def quorum(
        self,
        step: int,
        commit_failed: bool,
        timeout_s: float,
        *,
        round_step: int = 0,
        finished: bool = False,
        digest: str = "",
    ) -> Granted | JobEnd:
        """Block (at most timeout_s + connect_timeout_s) until a quorum containing this group forms.

        ``round_step`` is the inner step the group asks at (see ``QuorumRequest``). A
        ``finished`` group (``digest``: its global state's) may instead learn that the job ended.
        """
        check(timeout_s > 0, "cluster.timeouts.quorum", timeout_s, "must be > 0 seconds")
        fields = {
            "step": step,
            "round_step": round_step,
            "commit_failed": commit_failed,
            "timeout_s": timeout_s,
            "quorum_id": self._seen(0),
            "finished": finished,
            "digest": digest,
            "config": self.config,
        }
        answer = self._post("/quorum", fields, timeout_s + self.connect_timeout_s)
        try:
            if "end" in answer:
                return JobEnd.from_json(answer["end"])
            quorum = Quorum.from_json(answer["quorum"])
            store = (str(answer["store"]["host"]), int(answer["store"]["port"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LighthouseUnavailable(f"malformed quorum answer from {self.url}: {e!r}") from None
        if self.group not in quorum.participants:
            raise LighthouseUnavailable(f"quorum {quorum.quorum_id} from {self.url} lacks group {self.group!r}")
        self._seen(quorum.quorum_id)
        return quorum, store

    def _seen(self, quorum_id: int) -> int:
        with self._lock:
            self._last_quorum_id = max(self._last_quorum_id, quorum_id)
            return self._last_quorum_id

    def _post(self, path: str, fields: dict[str, Any], timeout_s: float) -> dict:
        body = json.dumps({"job": self.job_id, "signature": self.signature, "group": self.group, **fields})
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=body.encode(), headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            message = _error_message(e)
            if e.code == 504 and path == "/quorum":
                raise QuorumTimeout(message) from None
            if 400 <= e.code < 500:
                raise LighthouseRefused(e.code, message) from None
            raise LighthouseUnavailable(f"lighthouse at {self.url} answered {e.code} to {path}: {message}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise LighthouseUnavailable(f"lighthouse at {self.url} unreachable for {path}: {reason!r}") from None


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read())["error"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"HTTP {e.code} {e.reason}"
