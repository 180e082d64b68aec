"""The lighthouse's HTTP front: GET / (the status page), /status and /alive, POST to the protocol's endpoints.

Each request is handed to the ``Lighthouse`` the server carries (``server.lighthouse``); a body
over the limit or without a length is refused before it is read.

One thread reads every request with a selector and hands each POST to the lighthouse at once.
A quick one (heartbeat, recovery notice, commit: a lock and a few dictionary updates) is
answered on the spot; a long poll (a message with a ``timeout_s``) is parked: the lighthouse
keeps a ``Reply`` for it and calls it, from whichever thread decides its fate, with the answer.
Replies are queued, and this thread writes them: no thread waits per open request. A thread
per long poll cost every round at 1,000 groups 2,000 thread starts and their wake-ups fighting
for the GIL, and the last ask's grant came 1.4 s late
(experiments/scale/lighthouse_scale.py). Only the status page and /status, slow to render, get a
thread, which queues its answer the same way; /alive (the pid, for the launcher's watch) is
answered on the spot. An answer that does not fit the socket at once
is finished when the socket can take more.

Connections are kept alive: an HTTP/1.1 request without ``Connection: close`` gets its answer
with ``Connection: keep-alive``, and the connection waits for the client's next request, at
most ``KEEP_ALIVE_S``, then is closed (``LighthouseClient`` reuses one well within that). One
connection per request had cost every round at 1,000 groups 3,000 connection set-ups and
teardowns on the loop (the asks, lane watches and commits) besides the heartbeats'.
Anything malformed or refused before its body was read closes the connection after the answer.
"""

from __future__ import annotations

import collections
import functools
import ipaddress
import json
import logging
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Protocol

from diloco.ft import status_page
from diloco.ft.protocol import ENDPOINTS, MAX_BODY_BYTES, ErrorAnswer, ErrorCode, unreadable_post

log = logging.getLogger(__name__)

SERVER = "diloco-lighthouse/1"
# Every group asks for a round within the same second: the socketserver default of 5 pending
# connections reset some of 30 groups' requests on a busy machine.
LISTEN_BACKLOG = 4096
REQUEST_TIMEOUT_S = 30.0  # a client stalling mid-request, or not reading its answer, cannot hold a connection forever
KEEP_ALIVE_S = 30.0  # an idle kept-alive connection is closed after this (clients reuse one idle far less long)
SWEEP_EVERY_S = 0.5  # stalled connections are looked for this often, not at every event
MAX_HEAD_BYTES = 64 * 1024
DRAIN_BYTES = 16 * MAX_BODY_BYTES  # an over-long body is read up to this, so its sender reads the refusal


class Reply(Protocol):
    """The answer to a parked request: HTTP status, JSON object or its encoded bytes; callable from
    any thread, once. ``written`` is called (on the loop) once the answer is all handed to the socket."""

    def __call__(self, status: int, payload: dict | bytes, written: Callable[[], None] | None = None) -> None: ...


class _Connection:
    """One connection: a request's bytes until it is whole, then its answer's until they are sent,
    then (kept alive) the next request's."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.buffer = bytearray()
        self.deadline = time.monotonic() + REQUEST_TIMEOUT_S
        self.head: tuple[str, str, dict[str, str]] | None = None  # method, path, headers (lower-case names)
        self.needed = 0  # bytes of the whole request once the head is parsed
        self.body = b""  # the whole request's body
        self.keep = False  # whether the connection stays open for another request after this answer
        self.post = False  # counted in ``posts_in_flight`` until its answer is written
        self.parked = False  # a long poll whose answer is not decided yet (not in flight: see ``posts_in_flight``)
        self.answer = memoryview(b"")  # what is left to write
        self.written: Callable[[], None] | None = None  # called once a queued answer's last byte is sent
        self.events = 0  # what the loop's selector watches it for (0: not watched, as while a long poll is parked)

    def next_request(self) -> None:
        """Forget the answered request; bytes already read beyond it stay in ``buffer``."""
        self.head, self.needed, self.body, self.keep = None, 0, b"", False
        self.deadline = time.monotonic() + (REQUEST_TIMEOUT_S if self.buffer else KEEP_ALIVE_S)


class LighthouseHTTPServer:
    """Listens on ``address`` (port 0 picks a free one); ``serve_forever`` runs the selector loop
    until ``shutdown``. See the module docstring."""

    def __init__(self, address: tuple[str, int]) -> None:
        host, port = address
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(LISTEN_BACKLOG)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        _allow_open_files()
        # A connection's own address is the listening one, unless that is a wildcard (one system call per request).
        bound = self.server_address[0]
        self._local_host = None if ipaddress.ip_address(bound).is_unspecified else bound
        self.lighthouse: Any = None  # set by the lighthouse before serving
        self._selector = selectors.DefaultSelector()
        self._open: dict[socket.socket, _Connection] = {}  # watched by the loop's selector
        self._queued: collections.deque[_Connection] = collections.deque()  # answers decided off the loop
        self._wake_sent = False
        self._waker, self._wake = socket.socketpair()  # a byte on ``_wake`` wakes the loop for ``_queued``
        self._waker.setblocking(False)
        self._wake.setblocking(False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._posts = 0  # POSTs being handled or answered; changed only by the loop
        self._parked = 0  # of those, long polls with no answer decided yet; changed only by the loop

    def posts_in_flight(self) -> int:
        """POSTs being handled, or decided and not written yet (a lighthouse leaving waits for them).

        A long poll parked with no answer decided is not one: its group may have ended or died,
        and waiting for it meant waiting for its timeout (every job's end took up to 5 s more).
        Read from another thread in this order (queue, parked, posts), an answer the loop takes
        from the queue meanwhile is counted at least once: ``_write_queued`` unparks it first.
        """
        queued = len(self._queued)
        parked = self._parked
        return self._posts - parked + queued

    # -- the loop ----------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._selector.register(self._waker, selectors.EVENT_READ)
        swept = time.monotonic()
        try:
            while not self._stop.is_set():
                for key, events in self._selector.select(poll_interval):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._waker:
                        self._woken()
                    elif events & selectors.EVENT_WRITE:
                        self._write(self._open[key.fileobj])  # type: ignore[index]
                    else:
                        self._read(self._open[key.fileobj])  # type: ignore[index]
                    # Decided answers go out between two events, not after the whole batch: a round's
                    # grants otherwise waited behind up to 1,000 heartbeats and asks read in one batch.
                    self._write_queued()
                self._write_queued()
                now = time.monotonic()
                if now - swept > SWEEP_EVERY_S:
                    swept = now
                    for connection in [c for c in self._open.values() if c.deadline < now]:
                        self._close(connection)
            self._write_queued()  # the answers lighthouse.stop() gave its open long polls
        finally:
            self._selector.unregister(self.socket)
            self._selector.unregister(self._waker)
            self._stopped.set()

    def _write_queued(self) -> None:
        while self._queued:
            connection = self._queued[0]
            if connection.parked:
                connection.parked = False
                self._parked -= 1
            self._write(self._queued.popleft())

    def shutdown(self) -> None:
        """Stop the loop and wait for it; answers queued by then are written if the sockets take them at once."""
        self._stop.set()
        self._stopped.wait()

    def server_close(self) -> None:
        for connection in [*self._open.values(), *self._queued]:
            self._close(connection)
        self.socket.close()
        self._selector.close()
        self._waker.close()
        self._wake.close()

    def queue_answer(
        self,
        connection: _Connection,
        status: int,
        payload: dict | bytes,
        written: Callable[[], None] | None = None,
        *,
        content_type: str,
    ) -> None:
        """Have the loop write this answer (from any thread); the encoding happens here, off the loop."""
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        connection.answer = memoryview(_response(status, data, content_type, connection.keep))
        connection.written = written
        self._queued.append(connection)
        if not self._wake_sent:  # cleared by the loop after it read the wake-ups and before it takes the queue
            self._wake_sent = True
            try:
                self._wake.send(b"\0")
            except OSError:  # closed: the lighthouse stopped and server_close closed the rest
                pass

    def _accept(self) -> None:
        for _ in range(LISTEN_BACKLOG):
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # out of file descriptors, say: the connection waits in the backlog
                log.warning("lighthouse cannot accept a connection: %s", error)
                return
            sock.setblocking(False)
            # A kept-alive connection's answers go out as they are decided, not held back for an ACK (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(sock, str(address[0]))
            # A client sends its request as it connects: read at once, and most connections never
            # enter the selector (two system calls and a loop round less per request).
            if self._read(connection):
                self._watch(connection, selectors.EVENT_READ)

    def _read(self, connection: _Connection) -> bool:
        """Read what has come; whether the request still needs more."""
        try:
            data = connection.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:  # the client left (before its request was whole, or between two of them)
            self._close(connection)
            return False
        if connection.head is None and not connection.buffer:  # a kept-alive connection's next request begins
            connection.deadline = time.monotonic() + REQUEST_TIMEOUT_S
        connection.buffer += data
        return self._parse(connection)

    def _parse(self, connection: _Connection) -> bool:
        """Take the request in ``buffer`` once it is whole; whether it still needs more."""
        if connection.head is None:
            end = connection.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(connection.buffer) <= MAX_HEAD_BYTES:
                    return True
                self._answer(connection, *_error(ErrorAnswer(ErrorCode.BAD_REQUEST, "request head too long")))
                return False
            try:
                connection.head = _parse_head(bytes(connection.buffer[:end]))
            except ValueError as e:
                self._answer(connection, *_error(ErrorAnswer(ErrorCode.BAD_REQUEST, str(e))))
                return False
            del connection.buffer[: end + 4]
            method, _, headers = connection.head
            length = headers.get("content-length", "0") if method == "POST" else "0"
            connection.needed = min(int(length), DRAIN_BYTES) if length.isdigit() else 0
        if len(connection.buffer) < connection.needed:
            return True
        connection.body = bytes(connection.buffer[: connection.needed])
        del connection.buffer[: connection.needed]
        self._dispatch(connection)
        return False

    def _dispatch(self, connection: _Connection) -> None:
        """A whole request: answered here, parked with the lighthouse, or (a page) rendered by a thread."""
        assert connection.head is not None, "dispatched only once the head is parsed"
        method, path, headers = connection.head
        connection.keep = headers.get("connection", "").lower() != "close"
        if method == "POST":
            connection.post = True
            self._posts += 1
            if (error := unreadable_post(path, headers.get("content-length", ""))) is not None:
                connection.keep = False  # its body was not read (or drained only in part)
                return self._answer(connection, *_error(error))
            return self._guarded(self._post, connection)
        if method == "GET" and path == "/alive":
            return self._guarded(self._alive, connection)
        if method == "GET" and path in ("/", "/status"):
            self._watch(connection, 0)  # its answer is queued by the thread
            threading.Thread(target=self._guarded, args=(self._page, connection), daemon=True).start()
            return
        paths = f"GET / or /status or /alive, POST {' or '.join(ENDPOINTS)}"
        self._answer(connection, *_error(ErrorAnswer(ErrorCode.NOT_FOUND, f"unknown path {path!r}: {paths}")))

    def _guarded(self, answer: Callable[[_Connection], None], connection: _Connection) -> None:
        """Answer ``connection``; a bug in doing so is logged with its traceback and the connection
        closed unanswered, as ``socketserver`` did, and the lighthouse goes on serving."""
        try:
            answer(connection)
        except Exception:
            log.exception("lighthouse failed to answer %s from %s", connection.head, connection.peer)
            if connection.post:  # on the loop, which keeps the count
                self._close(connection)
            else:  # a page's thread
                connection.sock.close()

    def _post(self, connection: _Connection) -> None:
        assert connection.head is not None, "dispatched only once the head is parsed"
        _, path, headers = connection.head
        answer = self.lighthouse.handle_post(
            path,
            headers.get("authorization"),
            connection.body,
            self._local_host or connection.sock.getsockname()[0],
            connection.peer,
            functools.partial(self.queue_answer, connection, content_type="application/json"),
        )
        if answer is None:  # parked: the lighthouse calls the reply, which the loop writes
            connection.parked = True
            self._parked += 1
            return self._watch(connection, 0)
        status, payload = answer
        self._answer(connection, status, payload if isinstance(payload, bytes) else json.dumps(payload).encode())

    def _alive(self, connection: _Connection) -> None:
        self._answer(connection, 200, json.dumps(self.lighthouse.alive()).encode())

    def _page(self, connection: _Connection) -> None:
        """GET / or /status, off the loop: rendering 1,000 groups takes a while."""
        assert connection.head is not None, "dispatched only once the head is parsed"
        status = self.lighthouse.status()
        if connection.head[1] == "/status":
            self.queue_answer(connection, 200, json.dumps(status).encode(), content_type="application/json")
        else:
            page = status_page.render_html(status).encode()
            self.queue_answer(connection, 200, page, content_type="text/html; charset=utf-8")

    def _answer(
        self, connection: _Connection, status: int, data: bytes, content_type: str = "application/json"
    ) -> None:
        """Answer from the loop itself."""
        connection.answer = memoryview(_response(status, data, content_type, connection.keep))
        self._write(connection)

    def _woken(self) -> None:
        """Read the wake-ups, then let the next answer queued send one: cleared first, a wake-up sent
        meanwhile was read here while the flag said one was pending, and answers queued later stayed."""
        try:
            while self._waker.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        self._wake_sent = False

    def _write(self, connection: _Connection) -> None:
        """Write what the socket takes; the rest when it can take more. A client that left is no error."""
        try:
            sent = connection.sock.send(connection.answer)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            log.debug("a client left before its answer")
            return self._close(connection)
        connection.answer = connection.answer[sent:]
        if not connection.answer:
            if connection.written is not None:
                connection.written()
                connection.written = None
            if connection.keep and not self._stop.is_set():
                return self._keep(connection)
            try:
                connection.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return self._close(connection)
        if connection.events != selectors.EVENT_WRITE:
            connection.deadline = time.monotonic() + REQUEST_TIMEOUT_S
            self._watch(connection, selectors.EVENT_WRITE)

    def _keep(self, connection: _Connection) -> None:
        """The answer is out: wait for the connection's next request (or take one already read)."""
        if connection.post:
            connection.post = False
            self._posts -= 1
        connection.next_request()
        if connection.buffer and not self._parse(connection):
            return
        self._watch(connection, selectors.EVENT_READ)

    def _watch(self, connection: _Connection, events: int) -> None:
        """Have the selector watch ``connection`` for ``events`` (0: not at all). A request answered on
        the spot leaves its connection watched for reading, as it was: unwatching and watching it again
        were two system calls per heartbeat, about 7% of the loop's time at 1,000 groups."""
        if events == connection.events:
            return
        if not connection.events:
            self._open[connection.sock] = connection
            self._selector.register(connection.sock, events)
        elif not events:
            del self._open[connection.sock]
            self._selector.unregister(connection.sock)
        else:
            self._selector.modify(connection.sock, events)
        connection.events = events

    def _close(self, connection: _Connection) -> None:
        self._watch(connection, 0)
        connection.sock.close()
        connection.buffer, connection.answer = bytearray(), memoryview(b"")  # a parked poll's record outlives it
        if connection.post:
            connection.post = False
            self._posts -= 1


def _response(status: int, data: bytes, content_type: str, keep: bool) -> bytes:
    return _head(status, len(data), content_type, keep) + data


@functools.lru_cache(maxsize=256)  # a heartbeat's answer is the same every time: its head is built once
def _head(status: int, length: int, content_type: str, keep: bool) -> bytes:
    connection = f"keep-alive\r\nKeep-Alive: timeout={KEEP_ALIVE_S:.0f}" if keep else "close"
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nServer: {SERVER}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nCache-Control: no-store\r\nConnection: {connection}\r\n\r\n"
    ).encode()


def _allow_open_files() -> None:
    """Raise this process's open-file limit to its hard limit: every group keeps a few connections
    alive (heartbeats, its quorum ask, the lane watch), and a soft limit of 1,024 would turn
    groups away past a few hundred."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:
            log.debug("open-file limit stays at %d: %s", soft, error)


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, path without the query, headers by lower-case name); ``ValueError`` if malformed.

    HTTP/1.0 requests are kept alive only if they ask to be, HTTP/1.1 ones unless they ask not to
    be: the ``connection`` header is set accordingly."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError(f"malformed request line {lines[0][:100]!r}")
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"malformed header line {line[:100]!r}")
        headers[name.strip().lower()] = value.strip()
    if parts[2] != "HTTP/1.1" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"
    return parts[0], parts[1].split("?", 1)[0], headers


def _error(error: ErrorAnswer) -> tuple[int, bytes, str]:
    return error.code.status, json.dumps(error.to_json()).encode(), "application/json"
