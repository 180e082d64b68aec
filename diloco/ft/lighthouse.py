"""The lighthouse: one per job, it decides which replica groups take part in each outer sync.

Group leaders speak plain HTTP + JSON to it (standard library only; nothing received is ever
unpickled, DESIGN.md invariant 5). Heartbeats carry a group's committed step and the last
quorum id it saw; a quorum request is a long poll, answered once the pure ``QuorumBook``
(quorum.py) forms a quorum that contains the group. The lighthouse also hosts the job's
``TCPStore``, on which the outer lanes rendezvous, and a read-only status page for operators.
Its whole memory is rebuilt from heartbeats, so a restarted lighthouse needs no saved state.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch.distributed as dist

from diloco.config_base import check
from diloco.ft import status_page
from diloco.ft.quorum import Quorum, QuorumBook, QuorumRequest, QuorumRules

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
MAX_POLL_S = 300.0  # a long poll never outlives this, whatever the client asks for
DECIDE_EVERY_S = 0.02  # the join and heartbeat timeouts are noticed within this
MAX_GROUP_ID_CHARS = 200
_WILDCARD_HOSTS = {"", "0.0.0.0"}

# Body fields of each POST endpoint beyond job/signature/group: name -> (type, default or
# None when required). A quorum request may carry the last quorum id the group saw, so a
# restarted lighthouse never reuses an id even if a request reaches it before any heartbeat.
_FIELDS: dict[str, dict[str, tuple[type, Any]]] = {
    "/heartbeat": {"step": (int, None), "quorum_id": (int, None)},
    "/quorum": {"step": (int, None), "commit_failed": (bool, None), "timeout_s": (float, None), "quorum_id": (int, 0)},
}


_TYPES: dict[type, tuple[Callable[[Any], bool], str]] = {
    str: (lambda v: isinstance(v, str), "a string"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"),
    float: (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf,
        "a positive number of seconds",
    ),
}


@dataclass(frozen=True)
class LighthouseConfig:
    """Where the lighthouse listens; ``token`` is the job's secret (empty: none required)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port; a multi-host job sets a fixed one
    token: str = ""
    store_port: int = 0  # the TCPStore it hosts; 0 picks a free port
    history: int = 50  # quorums kept for /status

    def validate(self) -> None:
        check(bool(self.host), "cluster.lighthouse.host", self.host, "must be an address to bind, e.g. 127.0.0.1")
        for key in ("port", "store_port"):
            value = getattr(self, key)
            check(
                0 <= value <= 65535, f"cluster.lighthouse.{key}", value, "must be in [0, 65535] (0 picks a free port)"
            )
        check(
            self.port == 0 or self.port != self.store_port,
            "cluster.lighthouse.store_port",
            self.store_port,
            f"must differ from cluster.lighthouse.port={self.port} (or be 0 to pick a free port)",
        )
        check(self.history >= 1, "cluster.lighthouse.history", self.history, "must be >= 1 (quorums kept for /status)")


class LighthouseRefused(RuntimeError):
    """The lighthouse refused the request (token, job id, model signature, malformed request):
    the same request will be refused again, so fix the configuration instead of retrying.
    The lighthouse raises it internally too; ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class LighthouseUnavailable(RuntimeError):
    """The lighthouse could not be reached or failed (connection refused/reset, timeout, 5xx)."""


class QuorumTimeout(RuntimeError):
    """No quorum containing this group formed within the requested time; the request is withdrawn."""


@dataclass
class _Waiter:
    """One open long poll; the decision step fills in ``quorum`` or ``error`` and wakes it."""

    group: str
    quorum: Quorum | None = None
    error: tuple[int, str] | None = None


class Lighthouse:
    """Membership and quorums for one job, served over HTTP; see the module docstring."""

    def __init__(
        self,
        cfg: LighthouseConfig,
        rules: QuorumRules,
        job_id: str,
        model_signature: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        cfg.validate()
        rules.validate()
        self.cfg = cfg
        self.rules = rules
        self.job_id = job_id
        self._signature = model_signature  # None: pinned by the first accepted request
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._book = QuorumBook(rules)
        self._steps: dict[str, int] = {}
        self._waiters: dict[str, _Waiter] = {}
        self._current: tuple[Quorum, float] | None = None  # (quorum, formed at clock time)
        self._history: deque[dict[str, Any]] = deque(maxlen=cfg.history)
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._store: dist.TCPStore | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"lighthouse already serving at {self.url}")
        self._stopping.clear()
        self._store = dist.TCPStore(self.cfg.host, self.cfg.store_port, is_master=True, wait_for_workers=False)
        try:
            self._server = _Server((self.cfg.host, self.cfg.port), _Handler)
        except OSError as e:
            self._store = None
            raise OSError(f"lighthouse cannot listen on cluster.lighthouse.port={self.cfg.port}: {e}") from e
        self._server.lighthouse = self  # type: ignore[attr-defined]
        self._threads = [
            threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True),
            threading.Thread(target=self._decide_loop, daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("lighthouse for job %r serving at %s, store at %s:%d", self.job_id, self.url, *self.store_address)

    def stop(self) -> None:
        """Stop serving; open long polls are answered 503 at once. Bounded: threads get 5 s."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for t in self._threads:
            t.join(timeout=5.0)
        self._server, self._store, self._threads = None, None, []

    def __enter__(self) -> Lighthouse:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("lighthouse not started: call start() first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def store_address(self) -> tuple[str, int]:
        if self._store is None:
            raise RuntimeError("lighthouse not started: call start() first")
        return self.cfg.host, int(self._store.port)

    # -- requests ------------------------------------------------------------------------
    def handle_post(
        self, path: str, authorization: str | None, body: bytes, local_host: str, peer: str = "?"
    ) -> tuple[int, dict]:
        """Check and serve one POST; a refusal changes nothing in the lighthouse's state."""
        try:
            self._check_token(authorization)
            req = _parse_body(path, body)
            with self._cond:
                self._check_identity(req)
            if path == "/heartbeat":
                return self._heartbeat(req)
            store_host = local_host if self.cfg.host in _WILDCARD_HOSTS else self.cfg.host
            return self._quorum(req, store_host)
        except LighthouseRefused as refusal:
            log.warning("refused %s from %s (%d): %s", path, peer, refusal.status, refusal)
            return refusal.status, {"error": str(refusal)}

    def _check_token(self, authorization: str | None) -> None:
        if not self.cfg.token:
            return
        given = authorization[len("Bearer ") :] if authorization and authorization.startswith("Bearer ") else ""
        if not given:
            raise LighthouseRefused(401, "missing token: send 'Authorization: Bearer <cluster.lighthouse.token>'")
        if not hmac.compare_digest(given.encode(), self.cfg.token.encode()):
            raise LighthouseRefused(
                401, "wrong token: the request's token does not match the lighthouse's cluster.lighthouse.token"
            )

    def _check_identity(self, req: dict[str, Any]) -> None:
        """Job id, then model signature; pins the signature on the first accepted request."""
        if req["job"] != self.job_id:
            raise LighthouseRefused(409, f"job id {req['job']!r} differs from this lighthouse's job {self.job_id!r}")
        if self._signature is not None and req["signature"] != self._signature:
            raise LighthouseRefused(
                409,
                f"model signature {req['signature']} differs from the job's {self._signature}: "
                "the group runs a different model config",
            )
        self._signature = req["signature"]

    def _heartbeat(self, req: dict[str, Any]) -> tuple[int, dict]:
        with self._cond:
            self._book.heartbeat(req["group"], self._clock(), quorum_id_seen=req["quorum_id"], step=req["step"])
            self._steps[req["group"]] = req["step"]
        return 200, {"ok": True}

    def _quorum(self, req: dict[str, Any], store_host: str) -> tuple[int, dict]:
        group = req["group"]
        waiter = _Waiter(group)
        with self._cond:
            now = self._clock()
            deadline = now + min(req["timeout_s"], MAX_POLL_S)
            self._book.heartbeat(group, now, quorum_id_seen=req["quorum_id"])
            earlier = self._waiters.get(group)
            if earlier is not None:
                earlier.error = (409, f"superseded: group {group!r} sent a newer quorum request")
            self._waiters[group] = waiter
            self._steps[group] = req["step"]
            self._book.ask(QuorumRequest(group, req["step"], req["commit_failed"]), now)
            self._decide_locked(now)
            while waiter.quorum is None and waiter.error is None and not self._stopping.is_set():
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return 504, {"error": self._give_up_locked(waiter, req["timeout_s"])}
                self._cond.wait(min(remaining, 0.5))
            if waiter.quorum is not None:
                store = {"host": store_host, "port": self.store_address[1]}
                return 200, {"quorum": waiter.quorum.to_json(), "store": store}
            if waiter.error is not None:
                return waiter.error[0], {"error": waiter.error[1]}
            self._give_up_locked(waiter, req["timeout_s"])
            return 503, {"error": "the lighthouse is stopping; retry once it is back"}

    def _give_up_locked(self, waiter: _Waiter, timeout_s: float) -> str:
        """Withdraw a request whose wait ran out; the message says who could have joined it."""
        now = self._clock()
        healthy, asked = sorted(self._book.healthy(now)), sorted(self._book.pending)
        if self._waiters.get(waiter.group) is waiter:
            del self._waiters[waiter.group]
            self._book.withdraw(waiter.group)
        return (
            f"no quorum within {min(timeout_s, MAX_POLL_S):g} s: healthy groups {healthy}, asked {asked}; "
            f"a quorum needs cluster.min_groups={self.rules.min_groups} askers and a strict majority "
            f"of the healthy groups, after cluster.timeouts.join={self.rules.join_timeout_s:g} s"
        )

    # -- decisions -----------------------------------------------------------------------
    def _decide_loop(self) -> None:
        while not self._stopping.wait(DECIDE_EVERY_S):
            with self._cond:
                self._decide_locked(self._clock())

    def _decide_locked(self, now: float) -> None:
        """Run the pure rules once and wake every waiter whose fate they settled."""
        woken = False
        quorum = self._book.decide(now)
        if quorum is not None:
            self._current = (quorum, now)
            self._history.append({**quorum.to_json(), "formed_at": time.time()})
            log.info("quorum formed: %s", json.dumps(quorum.to_json()))
            if quorum.round_floor:
                log.warning(
                    "the job's newest state (round %d or later) was lost with every group that held it; "
                    "going on from round %d, the best surviving state",
                    quorum.round_floor - 1,
                    quorum.max_step,
                )
            for group in quorum.participants:
                waiter = self._waiters.pop(group, None)
                if waiter is not None:
                    waiter.quorum, woken = quorum, True
        for group in [g for g in self._waiters if g not in self._book.pending]:
            # The rules dropped the request: its group stopped heartbeating while it waited.
            hb = self.rules.heartbeat_timeout_s
            message = f"no heartbeat for cluster.timeouts.heartbeat={hb:g} s while it waited; keep heartbeating"
            self._waiters.pop(group).error = (504, f"request of group {group!r} dropped: {message}")
            woken = True
        if woken:
            self._cond.notify_all()

    # -- status --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What /status serves: a read-only snapshot, holding no secrets."""
        with self._cond:
            return status_page.build_status(
                self.job_id, self._signature, self._book, self._steps, self._current, self._history, self._clock()
            )


def _parse_body(path: str, body: bytes) -> dict[str, Any]:
    """The request's fields, type-checked; any problem is a 400 naming the field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise LighthouseRefused(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise LighthouseRefused(400, f"the body must be a JSON object, got {type(data).__name__}")
    spec = {"job": (str, None), "signature": (str, None), "group": (str, None), **_FIELDS[path]}
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise LighthouseRefused(400, f"unknown field {unknown[0]!r} for {path}; expected {sorted(spec)}")
    req = {}
    for name, (tp, default) in spec.items():
        if name not in data:
            if default is None:
                raise LighthouseRefused(400, f"missing field {name!r} for {path}; expected {sorted(spec)}")
            req[name] = default
            continue
        req[name] = value = data[name]
        ok, what = _TYPES[tp]
        if not ok(value):
            raise LighthouseRefused(400, f"field {name!r}={value!r} must be {what}")
    if not 0 < len(req["group"]) <= MAX_GROUP_ID_CHARS:
        raise LighthouseRefused(
            400, f"field 'group' must be 1 to {MAX_GROUP_ID_CHARS} characters, got {len(req['group'])}"
        )
    return req


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a long poll left open by a dead client never blocks stop()


class _Handler(BaseHTTPRequestHandler):
    server_version = "diloco-lighthouse/1"
    timeout = 30.0  # a client stalling mid-request cannot hold a thread forever

    def log_message(self, format: str, *args: Any) -> None:  # the base class's argument name
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        lighthouse: Lighthouse = self.server.lighthouse  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        if path == "/status":
            self._reply(200, json.dumps(lighthouse.status()).encode(), "application/json")
        elif path == "/":
            self._reply(200, status_page.render_html(lighthouse.status()).encode(), "text/html; charset=utf-8")
        else:
            self._reply_json(404, {"error": f"unknown path {path!r}: GET / or /status, POST /heartbeat or /quorum"})

    def do_POST(self) -> None:
        lighthouse: Lighthouse = self.server.lighthouse  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        length = self.headers.get("Content-Length", "")
        if path not in _FIELDS:
            self._reply_json(404, {"error": f"unknown path {path!r}: POST /heartbeat or /quorum"})
        elif not length.isdigit():
            self._reply_json(400, {"error": "a POST needs a Content-Length header"})
        elif int(length) > MAX_BODY_BYTES:
            self.rfile.read(min(int(length), 16 * MAX_BODY_BYTES))  # drained so the client reads the answer
            self._reply_json(400, {"error": f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}"})
        else:
            body = self.rfile.read(int(length))
            local_host, peer = self.connection.getsockname()[0], self.address_string()
            self._reply_json(*lighthouse.handle_post(path, self.headers.get("Authorization"), body, local_host, peer))

    def _reply_json(self, status: int, payload: dict) -> None:
        self._reply(status, json.dumps(payload).encode(), "application/json")

    def _reply(self, status: int, data: bytes, content_type: str) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            log.debug("client %s left before its answer", self.address_string())


def serve_forever(cfg: LighthouseConfig, rules: QuorumRules, job_id: str, model_signature: str | None = None) -> None:
    """Run a lighthouse alone until SIGINT or SIGTERM (call from the main thread)."""
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Lighthouse(cfg, rules, job_id, model_signature) as lighthouse:
            print(f"lighthouse for job {job_id!r} at {lighthouse.url}; status page {lighthouse.url}/", flush=True)
            while not done.wait(1.0):
                pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
