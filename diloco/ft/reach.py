"""A group leader's probes of its peers: a listener they connect to, and bounded connects to theirs.

The lighthouse cannot see that two groups fail to reach each other while both reach it
(``diloco.ft.reachability``). So each leader listens on a port of its own, which it tells the
lighthouse in every sign of life, and connects to its peers' listeners (their endpoints come in
the quorum grant, or in a heartbeat's answer while a cut stands): a connect that does not
complete within ``cluster.timeouts.probe`` means the peer is unreachable from here. A few times a
minute it also times its link to a few peers (``throughput_mbps``): what tells a slow link from the
others (docs/fault-tolerance.md, "A slow link"). The listener acts on nothing it reads; probes go
only to endpoints the lighthouse named, at most one per peer per probe, in parallel. Every lane of
a group crosses the links its leader's host has; a cut between two other hosts of two groups shows
as a failed lane the probes do not explain (docs/fault-tolerance.md, "Groups that cannot reach
each other").
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

MAX_PARALLEL_PROBES = 32
RATE_PROBE_BYTES = 256 * 1024  # what one throughput probe sends: long enough to time, cheap on a slow link
RATE_SAMPLES = 2  # back to back per peer, the faster kept: a busy core slows one, a slow link every one
MAX_OPEN_PROBES = 8  # connections a listener reads at once; more wait in its backlog
RATE_EVERY_S = 30.0  # a leader times its links to a few peers this often
RATE_PEERS = 3  # how many peers, in turn, each time
ROUND_PROBED_AFTER_S = 2.0  # a round still open this long gets its peers probed, once: a cut shows in seconds


class ReachListener:
    """A TCP port a peer's probe reaches. A connect alone is a reach probe; a throughput probe
    sends ``RATE_PROBE_BYTES``, which are read (never interpreted) in one call that returns once
    all arrived, and acknowledged with one byte, so the sender times their delivery. One call: a
    read loop in Python waits for the interpreter between reads, and on busy cores timed an
    unshaped link at a twentieth of its rate."""

    def __init__(self, host: str = "", timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self._socket = socket.create_server((host, 0), backlog=128)
        self._socket.settimeout(0.5)
        self._stop = threading.Event()
        self._open = threading.BoundedSemaphore(MAX_OPEN_PROBES)
        self._thread = threading.Thread(target=self._serve, name="reach-listener", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._socket.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:  # closed under it
                return
            self._open.acquire()
            threading.Thread(target=self._drain, args=(connection,), name="reach-drain", daemon=True).start()

    def _drain(self, connection: socket.socket) -> None:
        """Read a throughput probe's bytes and acknowledge them; a reach probe's connection just closes."""
        try:
            # Blocking, with the kernel's own timeout: Python's timeout makes the socket non-blocking,
            # where MSG_WAITALL returns what has arrived so far.
            connection.settimeout(None)
            seconds = int(self.timeout_s)
            timeval = struct.pack("ll", seconds, int((self.timeout_s - seconds) * 1e6))
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            buffer = bytearray(RATE_PROBE_BYTES)
            if connection.recv_into(buffer, RATE_PROBE_BYTES, socket.MSG_WAITALL) == RATE_PROBE_BYTES:
                connection.sendall(b"\x01")
        except OSError:
            pass
        finally:
            connection.close()
            self._open.release()


def probe(endpoints: Mapping[str, str], timeout_s: float) -> tuple[list[str], list[str]]:
    """Connect to every ``group -> "host:port"`` in parallel; the groups reached and those not within ``timeout_s``."""

    def reaches(endpoint: str) -> bool:
        host, _, port = endpoint.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
            return True
        except (OSError, ValueError):
            return False

    if not endpoints:
        return [], []
    groups = sorted(endpoints)
    with ThreadPoolExecutor(min(MAX_PARALLEL_PROBES, len(groups)), thread_name_prefix="reach-probe") as pool:
        results = list(pool.map(lambda g: reaches(endpoints[g]), groups))
    return [g for g, ok in zip(groups, results) if ok], [g for g, ok in zip(groups, results) if not ok]


def throughput_mbps(endpoint: str, timeout_s: float) -> float | None:
    """Megabits per second of ``RATE_PROBE_BYTES`` sent to a peer's listener until it acknowledged
    them; a link that does not deliver them within ``timeout_s`` counts as that many per
    ``timeout_s`` (at most that fast), and None if the peer cannot be reached or did not acknowledge."""
    host, _, port = endpoint.rpartition(":")
    nbytes = RATE_PROBE_BYTES
    started = time.monotonic()
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as connection:
            connection.sendall(bytes(nbytes))
            connection.shutdown(socket.SHUT_WR)
            if connection.recv(1) != b"\x01":
                return None
    except TimeoutError:
        return 8 * nbytes / timeout_s / 1e6
    except (OSError, ValueError):
        return None
    return 8 * nbytes / max(time.monotonic() - started, 1e-6) / 1e6


class ReachProbes:
    """The leader's probes and what it has not reported yet (its next sign of life carries them).

    ``probe_now`` runs on the caller's thread (once a lane failed, before the ask that reports it;
    before a new lane forms). A peer it did not reach is a suspect until the lighthouse's next word
    on whom to probe (``suspect``, a heartbeat's answer: the peers of its standing cuts): suspects
    are probed again every ``interval_s`` on a background thread, so a restored link is reported
    within about that time, and training never waits on a probe of a link that is still cut.
    Every result names the endpoint it probed, so one of a peer's earlier process counts for nothing.
    """

    def __init__(self, timeout_s: float, interval_s: float) -> None:
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.listener = ReachListener(timeout_s=timeout_s)
        self._lock = threading.Lock()
        self._results: dict[str, tuple[bool, str]] = {}  # peer -> (reached, endpoint), not reported yet
        self._rates: dict[str, float] = {}  # peer -> Mbit/s, not reported yet
        self._suspects: dict[str, str] = {}  # peers to probe again -> their endpoints
        # Peers a "reached" is news about (it reported them unreached, or the lighthouse asked): only
        # those are reported reached, so a round's asks at 1,000 groups do not carry 999 names each.
        self._in_doubt: set[str] = set()
        self._timed: dict[str, str] = {}  # the peers whose links it times (its last quorum's)
        self._turn = itertools.count()
        self._timed_at = -RATE_EVERY_S  # when it last timed links; a new set of peers is timed at once
        self._round: tuple[dict[str, str], float] | None = None  # the open round's peers, since when
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_suspects, name="reach-probes", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.listener.port

    @property
    def suspecting(self) -> bool:
        """Whether a cut may stand: the leader then beats every interval, whatever else it sent,
        since a heartbeat's answer is where the lighthouse says whom to probe."""
        with self._lock:
            return bool(self._suspects)

    def probe_now(self, endpoints: Mapping[str, str]) -> list[str]:
        """Probe ``endpoints`` and keep the results to report; the peers not reached."""
        reached, unreached = probe(endpoints, self.timeout_s)
        self._keep(reached, unreached, endpoints)
        if unreached:
            log.warning(
                "cannot reach group(s) %s within cluster.timeouts.probe=%gs", ", ".join(unreached), self.timeout_s
            )
        return unreached

    def time_links(self, endpoints: Mapping[str, str]) -> None:
        """Time the links to these peers (a quorum's), ``RATE_PEERS`` of them in turn every
        ``RATE_EVERY_S``, starting at once when they are new: what tells a slow link from a slow peer."""
        with self._lock:
            if dict(endpoints) != self._timed:
                self._timed, self._timed_at = dict(endpoints), -RATE_EVERY_S

    def round_opened(self, endpoints: Mapping[str, str]) -> None:
        """A round with these peers is under way: if it is still open after ``ROUND_PROBED_AFTER_S``,
        they are probed once, so a cut that holds its all-reduce up is reported (and the round
        ended for all its members) well before ``cluster.timeouts.collective``."""
        with self._lock:
            self._round = (dict(endpoints), time.monotonic())

    def round_closed(self) -> None:
        with self._lock:
            self._round = None

    def suspect(self, endpoints: Mapping[str, str]) -> None:
        """The peers to probe again from now on (the lighthouse's list, current endpoints)."""
        with self._lock:
            self._suspects = dict(endpoints)
            self._in_doubt |= endpoints.keys()

    def report(self) -> dict:
        """What the next sign of life carries (``protocol.ReachReport``), the results taken out."""
        with self._lock:
            results, self._results = self._results, {}
            rates, self._rates = self._rates, {}
        return {
            "port": self.port,
            "reached": {g: endpoint for g, (ok, endpoint) in sorted(results.items()) if ok},
            "unreached": {g: endpoint for g, (ok, endpoint) in sorted(results.items()) if not ok},
            "mbps": {g: round(rate, 3) for g, rate in sorted(rates.items())},
        }

    def keep_unsent(self, report: dict) -> None:
        """A report that did not arrive goes out again with the next one (newer results win)."""
        with self._lock:
            for key, ok in (("reached", True), ("unreached", False)):
                for group, endpoint in report.get(key, {}).items():
                    self._results.setdefault(group, (ok, endpoint))
            for group, rate in report.get("mbps", {}).items():
                self._rates.setdefault(group, rate)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1.0)
        self.listener.close()

    def _probe_suspects(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                suspects = dict(self._suspects)
                held_up = self._round is not None and time.monotonic() - self._round[1] >= ROUND_PROBED_AFTER_S
                if held_up:
                    suspects |= self._round[0]
                    self._round = None  # once per round
            if suspects:
                self._keep(*probe(suspects, self.timeout_s), suspects)
            self._time_some_links()

    def _time_some_links(self) -> None:
        """Every ``RATE_EVERY_S``: ``RATE_PEERS`` of the timed peers in turn, one at a time (a
        probe shares the link with no other probe of this leader)."""
        with self._lock:
            if not self._timed or time.monotonic() - self._timed_at < RATE_EVERY_S:
                return
            self._timed_at = time.monotonic()
            peers = sorted(self._timed)
            start = next(self._turn) * RATE_PEERS
            chosen = {peers[(start + i) % len(peers)] for i in range(min(RATE_PEERS, len(peers)))}
            endpoints = {g: self._timed[g] for g in chosen}
        for group, endpoint in sorted(endpoints.items()):
            rates = [r for _ in range(RATE_SAMPLES) if (r := throughput_mbps(endpoint, self.timeout_s)) is not None]
            if rates:
                with self._lock:
                    self._rates[group] = max(rates)

    def _keep(self, reached: list[str], unreached: list[str], endpoints: Mapping[str, str]) -> None:
        with self._lock:
            self._results.update({g: (True, endpoints[g]) for g in reached if g in self._in_doubt})
            self._results.update({g: (False, endpoints[g]) for g in unreached})
            for group in reached:
                self._suspects.pop(group, None)
                self._in_doubt.discard(group)
            self._suspects.update({g: endpoints[g] for g in unreached})
            self._in_doubt |= set(unreached)
