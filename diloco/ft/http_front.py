"""The lighthouse's HTTP front: GET / (the status page) and /status, POST to the protocol's endpoints.

Each request is handed to the ``Lighthouse`` the server carries (``server.lighthouse``); a body
over the limit or without a length is refused before it is read.

One thread reads every request with a selector and answers the quick ones itself (heartbeats,
recovery notices, commits: a lock and a few dictionary updates); a long poll (a message with a
``timeout_s``) or a status page gets a thread of its own, which writes its answer and closes
the connection. A thread per connection, as ``ThreadingHTTPServer`` gives, cost 0.3 ms of CPU
per request before the lighthouse saw it: at 1,000 groups heartbeating 4 times per 3 s that
alone was most of a core (issue 33, experiments/lighthouse_scale.py). Every answer is
HTTP/1.0 with its length, and the connection closes after it, as the clients expect.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from http import HTTPStatus
from typing import Any

from diloco.ft import status_page
from diloco.ft.protocol import ENDPOINTS, MAX_BODY_BYTES, ErrorAnswer, ErrorCode, unreadable_post

log = logging.getLogger(__name__)

SERVER = "diloco-lighthouse/1"
# Every group asks for a round within the same second: the socketserver default of 5 pending
# connections reset some of 30 groups' requests on a busy machine (issue 33).
LISTEN_BACKLOG = 1024
REQUEST_TIMEOUT_S = 30.0  # a client stalling mid-request cannot hold a connection forever
MAX_HEAD_BYTES = 64 * 1024
DRAIN_BYTES = 16 * MAX_BODY_BYTES  # an over-long body is read up to this, so its sender reads the refusal


class _Request:
    """One connection's bytes until its request is whole."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.buffer = bytearray()
        self.deadline = time.monotonic() + REQUEST_TIMEOUT_S
        self.head: tuple[str, str, dict[str, str]] | None = None  # method, path, headers (lower-case names)
        self.needed = 0  # bytes of the whole request once the head is parsed


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
        self.lighthouse: Any = None  # set by the lighthouse before serving
        self._selector = selectors.DefaultSelector()
        self._pending: dict[socket.socket, _Request] = {}
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._posts_lock = threading.Lock()
        self._posts = 0  # POSTs being handled or answered
        self._loop_thread: threading.Thread | None = None

    def posts_in_flight(self) -> int:
        """POSTs whose answer has not been written yet (a lighthouse leaving waits for them)."""
        with self._posts_lock:
            return self._posts

    def _count_post(self, change: int) -> None:
        with self._posts_lock:
            self._posts += change

    # -- the loop ----------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        self._loop_thread = threading.current_thread()
        self._selector.register(self.socket, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(poll_interval):
                    if key.fileobj is self.socket:
                        self._accept()
                    else:
                        self._read(self._pending[key.fileobj])  # type: ignore[index]
                now = time.monotonic()
                for request in [r for r in self._pending.values() if r.deadline < now]:
                    self._drop(request)
        finally:
            self._selector.unregister(self.socket)
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop the loop and wait for it; answers being written by their threads still go out."""
        self._stop.set()
        self._stopped.wait()

    def server_close(self) -> None:
        for request in list(self._pending.values()):
            self._drop(request)
        self.socket.close()
        self._selector.close()

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
            self._pending[sock] = _Request(sock, str(address[0]))
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, request: _Request) -> None:
        try:
            data = request.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client left before its request was whole
            return self._drop(request)
        request.buffer += data
        if request.head is None:
            end = request.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(request.buffer) > MAX_HEAD_BYTES:
                    self._answer_now(request, *_error(ErrorAnswer(ErrorCode.BAD_REQUEST, "request head too long")))
                return
            try:
                request.head = _parse_head(bytes(request.buffer[:end]))
            except ValueError as e:
                return self._answer_now(request, *_error(ErrorAnswer(ErrorCode.BAD_REQUEST, str(e))))
            del request.buffer[: end + 4]
            method, _, headers = request.head
            length = headers.get("content-length", "0") if method == "POST" else "0"
            request.needed = min(int(length), DRAIN_BYTES) if length.isdigit() else 0
        if len(request.buffer) >= request.needed:
            self._dispatch(request)

    def _dispatch(self, request: _Request) -> None:
        """A whole request: answered here if it is quick, else by a thread of its own."""
        assert request.head is not None, "dispatched only once the head is parsed"
        method, path, headers = request.head
        self._selector.unregister(request.sock)
        del self._pending[request.sock]
        if method == "POST":
            self._count_post(1)
            length = headers.get("content-length", "")
            if (error := unreadable_post(path, length)) is not None:
                return self._send(request.sock, *_error(error), post=True)
            if "timeout_s" not in ENDPOINTS[path].__dataclass_fields__:
                return self._guarded(self._answer, request)
        threading.Thread(target=self._guarded, args=(self._answer, request), daemon=True).start()

    def _guarded(self, answer: Any, request: _Request) -> None:
        """Answer ``request``; a bug in doing so is logged with its traceback and the connection
        closed unanswered, as ``socketserver`` did, and the lighthouse goes on serving."""
        try:
            answer(request)
        except Exception:
            log.exception("lighthouse failed to answer %s from %s", request.head, request.peer)
            request.sock.close()
            if request.head is not None and request.head[0] == "POST":
                self._count_post(-1)

    def _answer(self, request: _Request) -> None:
        assert request.head is not None, "dispatched only once the head is parsed"
        method, path, headers = request.head
        if threading.current_thread() is not self._loop_thread:
            request.sock.setblocking(True)
            request.sock.settimeout(REQUEST_TIMEOUT_S)
        if method == "POST":
            return self._send(request.sock, *self._post(request, path, headers), post=True)
        lighthouse = self.lighthouse
        if method == "GET" and path == "/status":
            self._send(request.sock, 200, json.dumps(lighthouse.status()).encode(), "application/json")
        elif method == "GET" and path == "/":
            page = status_page.render_html(lighthouse.status()).encode()
            self._send(request.sock, 200, page, "text/html; charset=utf-8")
        else:
            paths = f"GET / or /status, POST {' or '.join(ENDPOINTS)}"
            self._send(request.sock, *_error(ErrorAnswer(ErrorCode.NOT_FOUND, f"unknown path {path!r}: {paths}")))

    def _post(self, request: _Request, path: str, headers: dict[str, str]) -> tuple[int, bytes, str]:
        local_host = request.sock.getsockname()[0]
        body = bytes(request.buffer[: int(headers["content-length"])])
        status, payload = self.lighthouse.handle_post(
            path, headers.get("authorization"), body, local_host, request.peer
        )
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return status, data, "application/json"

    def _answer_now(self, request: _Request, status: int, data: bytes, content_type: str) -> None:
        self._selector.unregister(request.sock)
        del self._pending[request.sock]
        self._send(request.sock, status, data, content_type)

    def _send(self, sock: socket.socket, status: int, data: bytes, content_type: str, post: bool = False) -> None:
        """Write the answer and close; a non-blocking socket that cannot take it all hands the rest to a thread."""
        head = (
            f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\nServer: {SERVER}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(data)}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"
        )
        answer = head.encode() + data
        try:
            sent = sock.send(answer) if sock.gettimeout() == 0 else 0
            if sent < len(answer):
                if sock.gettimeout() == 0:
                    rest = memoryview(answer)[sent:]
                    threading.Thread(target=self._send_rest, args=(sock, rest, post), daemon=True).start()
                    return
                sock.sendall(answer)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            log.debug("a client left before its answer")
        sock.close()
        if post:
            self._count_post(-1)

    def _send_rest(self, sock: socket.socket, rest: memoryview, post: bool) -> None:
        sock.setblocking(True)
        sock.settimeout(REQUEST_TIMEOUT_S)
        try:
            sock.sendall(rest)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            log.debug("a client left before its answer")
        sock.close()
        if post:
            self._count_post(-1)

    def _drop(self, request: _Request) -> None:
        self._selector.unregister(request.sock)
        del self._pending[request.sock]
        request.sock.close()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, path without the query, headers by lower-case name); ``ValueError`` if malformed."""
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
    return parts[0], parts[1].split("?", 1)[0], headers


def _error(error: ErrorAnswer) -> tuple[int, bytes, str]:
    return error.code.status, json.dumps(error.to_json()).encode(), "application/json"
