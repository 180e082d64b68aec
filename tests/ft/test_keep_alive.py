"""Kept-alive connections between a group's client and the lighthouse.

The client side runs against a scripted stand-in server that counts connections and can close
or stall one; the lighthouse's side is spoken to over raw sockets. Waits are hang guards, not
measurements.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable

import pytest

from diloco.config.cluster import LighthouseConfig, QuorumRules
from diloco.ft import http_front
from diloco.ft.client import LighthouseClient
from diloco.ft.lighthouse import Lighthouse
from diloco.ft.protocol import Heartbeat, LighthouseUnavailable
from tests.hang_guard import guarded

JOB, SIG, TOKEN = "job-1", "sig-abc", "s3cret"
GUARD_S = 10.0


class ScriptedServer:
    """Answers each request ``{"ok": true}`` kept alive, unless ``act(connection, request)`` (both
    counted from 1) says "last" (answer, then close), "close" (close without answering) or
    "stall" (never answer)."""

    def __init__(self, act: Callable[[int, int], str] = lambda c, r: "answer") -> None:
        self.act = act
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.requests = 0
        self._stalled: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock, self.connections), daemon=True).start()

    def _serve(self, sock: socket.socket, connection: int) -> None:
        reader = sock.makefile("rb")
        for index in range(1, 1000):
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = reader.readline()
                if not line:
                    return sock.close()
                head += line
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
            reader.read(length)
            self.requests += 1
            action = self.act(connection, index)
            if action == "close":
                return sock.close()
            if action == "stall":
                self._stalled.append(sock)
                return
            body = b'{"ok": true}'
            sock.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            if action == "last":
                return sock.close()

    def close(self) -> None:
        self.listener.close()
        for sock in self._stalled:
            sock.close()


@pytest.fixture
def scripted():
    servers: list[ScriptedServer] = []

    def make(act: Callable[[int, int], str] = lambda c, r: "answer") -> ScriptedServer:
        servers.append(ScriptedServer(act))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def client(url: str, connect_timeout_s: float = 5.0) -> LighthouseClient:
    return LighthouseClient(url, token=TOKEN, job_id=JOB, signature=SIG, group="A", connect_timeout_s=connect_timeout_s)


def test_many_requests_travel_over_one_connection(scripted):
    server = scripted()
    c = client(server.url)
    for step in range(30):
        assert guarded(lambda: c.heartbeat(step, 0), GUARD_S) == {}, "no peer to probe again"
    assert (server.requests, server.connections) == (30, 1)


def test_a_connection_the_server_closed_is_replaced_without_the_caller_noticing(scripted):
    """Closed while idle (the lighthouse's idle bound), or as the next request went out: the
    request goes out again on a fresh connection, once."""
    script = {(1, 2): "last", (2, 2): "close"}
    server = scripted(lambda connection, request: script.get((connection, request), "answer"))
    c = client(server.url)
    for step in range(6):
        assert guarded(lambda: c.heartbeat(step, 0), GUARD_S) == {}, f"heartbeat {step} failed"
    assert server.connections == 3, "the closed connections were not replaced"


def test_a_lighthouse_that_stops_answering_on_a_kept_connection_times_out_within_the_limit(scripted):
    server = scripted(lambda connection, request: "stall" if request == 2 else "answer")
    c = client(server.url, connect_timeout_s=0.3)
    assert guarded(lambda: c.heartbeat(0, 0), GUARD_S) == {}
    error = guarded(lambda: c.heartbeat(1, 0), GUARD_S)  # on the kept connection, which now never answers
    assert isinstance(error, LighthouseUnavailable) and "timed out" in str(error), error
    assert server.connections == 1, "a timed-out request is not sent again"


@pytest.fixture
def lighthouse():
    lh = Lighthouse(LighthouseConfig(port=0, token=TOKEN), QuorumRules(heartbeat_timeout_s=30.0), JOB, SIG)
    lh.start()
    yield lh
    lh.stop()


def heartbeat_request(step: int, version: str = "HTTP/1.1", extra: str = "") -> bytes:
    body = json.dumps(Heartbeat(JOB, SIG, "A", step=step, quorum_id=0).to_json()).encode()
    head = f"POST {Heartbeat.path} {version}\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n"
    return (head + extra + "\r\n").encode() + body


def read_answer(reader) -> tuple[str, dict[str, str], bytes]:  # noqa: ANN001
    status = reader.readline().decode().strip()
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    return status, headers, reader.read(int(headers["content-length"]))


def test_the_lighthouse_answers_requests_one_after_another_on_one_connection(lighthouse):
    with socket.create_connection(("127.0.0.1", lighthouse.port), timeout=GUARD_S) as sock:
        reader = sock.makefile("rb")
        sock.sendall(heartbeat_request(1))
        for step in (2, 3):  # the last two sent back to back, the second read with the first
            status, headers, body = read_answer(reader)
            assert status == "HTTP/1.1 200 OK" and headers["connection"] == "keep-alive", (status, headers)
            sock.sendall(heartbeat_request(step) + (heartbeat_request(step + 1) if step == 3 else b""))
        answers = [read_answer(reader) for _ in range(2)]
        assert [json.loads(body) for _, _, body in answers] == [{"ok": True}] * 2
        sock.sendall(heartbeat_request(5, extra="Connection: close\r\n"))
        status, headers, _ = read_answer(reader)
        assert headers["connection"] == "close" and reader.read() == b"", "asked to close, it stays open"


def test_an_http_1_0_request_gets_its_answer_and_the_connection_closes(lighthouse):
    with socket.create_connection(("127.0.0.1", lighthouse.port), timeout=GUARD_S) as sock:
        reader = sock.makefile("rb")
        sock.sendall(heartbeat_request(1, version="HTTP/1.0"))
        _, headers, _ = read_answer(reader)
        assert headers["connection"] == "close" and reader.read() == b""


def test_the_lighthouse_closes_a_connection_left_idle(lighthouse, monkeypatch):
    """No connection is held forever: an idle one is closed after ``KEEP_ALIVE_S``."""
    monkeypatch.setattr(http_front, "KEEP_ALIVE_S", 0.2)
    with socket.create_connection(("127.0.0.1", lighthouse.port), timeout=GUARD_S) as sock:
        reader = sock.makefile("rb")
        sock.sendall(heartbeat_request(1))
        status, _, _ = read_answer(reader)
        assert status == "HTTP/1.1 200 OK"
        assert reader.read() == b"", "the idle connection was not closed"  # EOF, within the guard
