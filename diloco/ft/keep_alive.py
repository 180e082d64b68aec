"""Kept-alive HTTP connections to the lighthouse, one per request in flight.

A group's client sends from several threads at once (heartbeats, the quorum long poll, the
round and lane watches), and a connection carries one request at a time: each request takes
an idle connection, or opens one, and gives it back once its answer is read. At 1,000 groups a
TCP connection per request cost the lighthouse's loop a set-up and teardown per heartbeat, ask,
lane watch and commit (experiments/scale/lighthouse_scale.py).

Every request still has its own timeout, the socket's, for the connection, the sending and
each read, as a fresh connection's had: a dead or hung lighthouse fails a request after it,
reused connection or not. The lighthouse closes connections idle for ``KEEP_ALIVE_S``
(``http_front``); a connection is reused only while idle far less long, and one the server
closed meanwhile (its end readable: nothing else may come before our request) is not reused.
If the server closes a reused connection just as the request goes out, the request is sent
once more on a fresh one: the server closes only connections with no request in them, so
it had not seen this one.
"""

from __future__ import annotations

import http.client
import select
import threading
import time
import urllib.parse

from diloco.config.base import check

REUSE_IDLE_S = 10.0  # below the lighthouse's KEEP_ALIVE_S (30 s), so it never closes one we are about to use
MAX_IDLE = 8  # idle connections kept: more than a group's threads ever have requests in flight at once


class Answer:
    """An HTTP answer read whole: status, reason phrase, body."""

    def __init__(self, status: int, reason: str, body: bytes) -> None:
        self.status, self.reason, self.body = status, reason, body


class ConnectionPool:
    """Kept-alive connections to the ``http://host:port`` of ``url``; thread-safe."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        check(parts.scheme == "http" and bool(parts.hostname), "lighthouse url", url, "must be http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port or 80
        self._lock = threading.Lock()
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []  # (connection, idle since), newest last

    def post(self, path: str, body: bytes, headers: dict[str, str], timeout_s: float) -> Answer:
        """POST ``body`` and read the whole answer, within ``timeout_s`` per socket operation.

        Raises ``OSError`` (a timeout, a refused or reset connection) or ``http.client.HTTPException``.
        """
        connection = self._take()
        if connection is not None:
            try:
                return self._exchange(connection, path, body, headers, timeout_s)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                pass  # closed by the server as the request went out: it never saw it (module docstring)
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        return self._exchange(connection, path, body, headers, timeout_s)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection, _ in idle:
            connection.close()

    def _exchange(
        self, connection: http.client.HTTPConnection, path: str, body: bytes, headers: dict[str, str], timeout_s: float
    ) -> Answer:
        connection.timeout = timeout_s  # a new connection's connect; a reused one's socket below
        if connection.sock is not None:
            connection.sock.settimeout(timeout_s)
        try:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            answer = Answer(response.status, response.reason, response.read())
        except BaseException:
            connection.close()
            raise
        if response.will_close:
            connection.close()
        else:
            self._give_back(connection)
        return answer

    def _take(self) -> http.client.HTTPConnection | None:
        """The newest idle connection still fit to use; the others' sockets are closed."""
        now = time.monotonic()
        with self._lock:
            while self._idle:
                connection, since = self._idle.pop()
                if now - since < REUSE_IDLE_S and not _closed_by_server(connection):
                    return connection
                connection.close()
        return None

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append((connection, time.monotonic()))
            surplus, self._idle = self._idle[:-MAX_IDLE], self._idle[-MAX_IDLE:]
        for old, _ in surplus:
            old.close()


def _closed_by_server(connection: http.client.HTTPConnection) -> bool:
    """Whether an idle connection's socket is readable: the server closed it (or sent what we never asked for)."""
    if connection.sock is None:
        return True
    poller = select.poll()  # not select(): a process with over 1,024 files open may be using this
    poller.register(connection.sock, select.POLLIN)
    return bool(poller.poll(0))
