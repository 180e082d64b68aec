"""The lighthouse's HTTP front: GET / (the status page) and /status, POST to the protocol's endpoints.

Each request is handed to the ``Lighthouse`` the server carries (``server.lighthouse``); a body
over the limit or without a length is refused before it is read.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from diloco.ft import status_page
from diloco.ft.protocol import ENDPOINTS, MAX_BODY_BYTES, ErrorAnswer, ErrorCode, unreadable_post

log = logging.getLogger(__name__)


class LighthouseHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a long poll left open by a dead client never blocks stop()
    # Every group asks for a round within the same second: the socketserver default of 5
    # pending connections reset some of 30 groups' requests on a busy machine (issue 33).
    request_queue_size = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._posts_lock = threading.Lock()
        self._posts = 0  # POSTs being handled or answered

    def posts_in_flight(self) -> int:
        """POSTs whose answer has not been written yet (a lighthouse leaving waits for them)."""
        with self._posts_lock:
            return self._posts

    def count_post(self, change: int) -> None:
        with self._posts_lock:
            self._posts += change


class LighthouseRequestHandler(BaseHTTPRequestHandler):
    server_version = "diloco-lighthouse/1"
    timeout = 30.0  # a client stalling mid-request cannot hold a thread forever

    def log_message(self, format: str, *args: Any) -> None:  # the base class's argument name
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        lighthouse = self.server.lighthouse  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        if path == "/status":
            self._reply(200, json.dumps(lighthouse.status()).encode(), "application/json")
        elif path == "/":
            self._reply(200, status_page.render_html(lighthouse.status()).encode(), "text/html; charset=utf-8")
        else:
            paths = f"GET / or /status, POST {' or '.join(ENDPOINTS)}"
            self._reply_error(ErrorAnswer(ErrorCode.NOT_FOUND, f"unknown path {path!r}: {paths}"))

    def do_POST(self) -> None:
        self.server.count_post(1)  # type: ignore[attr-defined]
        try:
            self._post()
        finally:
            self.server.count_post(-1)  # type: ignore[attr-defined]

    def _post(self) -> None:
        lighthouse = self.server.lighthouse  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        length = self.headers.get("Content-Length", "")
        if (error := unreadable_post(path, length)) is not None:
            if length.isdigit():  # drained (up to a bound) so the client reads the answer
                self.rfile.read(min(int(length), 16 * MAX_BODY_BYTES))
            self._reply_error(error)
        else:
            body = self.rfile.read(int(length))
            local_host, peer = self.connection.getsockname()[0], self.address_string()
            self._reply_json(*lighthouse.handle_post(path, self.headers.get("Authorization"), body, local_host, peer))

    def _reply_json(self, status: int, payload: dict) -> None:
        self._reply(status, json.dumps(payload).encode(), "application/json")

    def _reply_error(self, error: ErrorAnswer) -> None:
        self._reply_json(error.code.status, error.to_json())

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
