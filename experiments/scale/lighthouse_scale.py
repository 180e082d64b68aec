"""The lighthouse alone against 100, 300 and 1,000 simulated replica groups on loopback.

The real lighthouse process (``python -m diloco.launch.lighthouse_process``, started as the
local launcher starts it) serves a job of N groups; the groups are simulated by a few sender
processes that speak the real protocol over HTTP: every group heartbeats at the default rate
(``cluster.timeouts.heartbeat`` / ``HEARTBEATS_PER_TIMEOUT``, with progress for the status
page; an ask or commit stands for a beat, as in the real client), asks for a quorum every
window (a long poll, asks spread over ``--spread`` seconds), and a few groups die (the
launcher's ``/recovery`` notice follows at once) and come back after ``REJOIN_S`` to heal. The
launcher's own watch asks ``/alive`` twice a second; an operator loads the status page and
``/status`` every 5 s.

Measured: quorum latency from the last ask (when each participant's answer reached its socket,
the kernel's receive stamp, minus when the round's last ask went out; steady rounds after the
start; p50/p99, the p99 until the senders had read them beside it, and each round's median and
maximum in the JSON with when the lighthouse formed it and handed its last grant to a socket),
heartbeat round trips the same way, the lighthouse process's own CPU time (/proc/PID/stat) as a share of
one core with heartbeats only and under the whole load, its resident memory (peak), and how
long ``/status`` and the page take. Targets at 1,000 groups: quorum p99 within 100 ms, the
lighthouse under half a core, the page under 1 s.

The sender processes use raw HTTP/1.1 requests from one asyncio loop each, not
``LighthouseClient``: 1,000 groups of blocking clients would be 2,000 threads and about twice
the CPU on two cores that the lighthouse needs for itself. Like the real client
(``diloco.ft.keep_alive``), each group keeps its connections alive: a request takes one of
the group's idle connections or opens one, so a group holds about one per request it has in
flight at once (heartbeat, quorum ask or commit, lane watch). The bodies are the protocol's
own messages (``diloco.ft.protocol``), and answers are parsed with its functions.

    python -m experiments.scale.lighthouse_scale            # 100, 300 and 1,000 groups: ~5 min on two cores
    python -m experiments.scale.lighthouse_scale --quick    # 100 groups, 4 rounds 2 s apart: ~20 s
    python -m experiments.scale.lighthouse_scale --nice -20 # as root on a shared machine (the table in docs/results/scale.md)
    python -m experiments.scale.lighthouse_scale --lighthouse-cpus 0  # the lighthouse on a core of its own
    python -m experiments.scale.lighthouse_scale --groups 1000 --rounds 20

Prints a markdown table and the target checks to stdout and experiments/results/lighthouse_scale.md
(the numbers also to lighthouse_scale.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from diloco.config.base import to_dict
from diloco.config.job import training_config
from diloco.ft.identity import config_digest
from diloco.ft.protocol import (
    ENDPOINTS,
    GroupProgress,
    Heartbeat,
    QuorumAsk,
    RecoveryNotice,
    authorization_header,
    quorum_answer_from_json,
)
from diloco.launch.local_cluster import resolve_lighthouse, serving_pid
from diloco.launch.spawn import exec_lighthouse
from diloco.library.build import HEARTBEATS_PER_TIMEOUT
from diloco.lifeline import Lifeline
from experiments.common import (
    add_output_arguments,
    compose_job,
    markdown_table,
    runs_root,
    stop_on_sigterm,
    verdict,
    write_result,
)

SIGNATURE = "lighthouse-scale"
REJOIN_S = 1.5  # a dead group's replacement starts this long after the death
WATCH_EVERY_S = 0.5  # the launcher's watch on /alive (diloco.launch.lighthouse_watch.ASK_EVERY_S)
PAGE_EVERY_S = 5.0  # an operator's browser on the status page, a dashboard on /status
TARGET_P99_MS = 100.0
TARGET_CPU = 0.5
TARGET_PAGE_S = 1.0
ALL_REDUCE_S = 0.2  # from a grant to the group's commit: its round's all-reduce
# The calls beside the quorum: a group holds a "lane watch" long poll open across its
# rounds (answered when a member leaves its round, or after the quorum timeout), and it confirms
# its commit once per round. Looked up by path, so a protocol without them is simulated without.
LANE_WATCH_PATH = "/lane_watch"
COMMIT_PATH = "/commit"
SIGNS_OF_LIFE = (Heartbeat.path, QuorumAsk.path, COMMIT_PATH)  # the lighthouse takes each as a heartbeat


@dataclass
class Plan:
    """What the simulated groups do, on the shared monotonic clock (seconds)."""

    url: str
    token: str
    job: str
    config: dict[str, Any]
    heartbeat_s: float
    quorum_timeout_s: float
    start: float  # heartbeats begin
    rounds_at: float  # the first (start) round's asks; round k's asks at rounds_at + k * window
    window_s: float
    spread_s: float
    rounds: int
    deaths: dict[str, float] = field(default_factory=dict)  # group -> when it dies (rejoins REJOIN_S later)

    @property
    def end(self) -> float:
        return self.rounds_at + (self.rounds + 0.5) * self.window_s


@dataclass
class Ask:
    """One quorum request and its answer, as a simulated group saw it."""

    group: str
    asked: float  # the request went out
    answered: float  # the answer had reached the group's socket
    quorum_id: int
    max_step: int
    participants: int
    read: float | None = None  # the sender had read it (None: as answered)


# -- the simulated groups (sender processes) -----------------------------------------------------
class Answer(NamedTuple):
    status: int
    body: bytes
    sent: float  # when the request went out on its connection (monotonic clock)
    received: float  # when the answer's last byte reached the group's socket (the kernel's stamp)
    read: float  # when the sender's loop read it


class _Channel:
    """One kept-alive connection: one request at a time, its answer whole once its Content-Length came.

    A bare socket watched by the loop, not asyncio's streams, and the times are taken here, as
    the bytes go out and come in. An answer's arrival is the kernel's receive stamp of its last
    bytes (``SO_TIMESTAMPNS``): when it reached the group's socket. Each real group reads its own
    socket on a host of its own; here two senders simulate 1,000 groups on the cores the
    lighthouse uses, and one busy with its 500 grants of a round read some of them over 100 ms
    after they had come. When the sender read it is kept too (``read``).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closed = False
        self.buffer = bytearray()
        self.whole_at = -1  # the answer's length in bytes, once its head is read
        self.sent = 0.0
        self.waiter: asyncio.Future[tuple[bytes, float, float]] | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> _Channel:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        try:
            await loop.sock_connect(sock, (host.strip("[]"), port))
        except BaseException:
            sock.close()
            raise
        channel = cls(sock)
        loop.add_reader(sock, channel._readable)
        return channel

    def send(self, request: bytes) -> asyncio.Future[tuple[bytes, float, float]]:
        """The answer's bytes, when its last byte came in and when it was read. A request is a few KiB
        at most, into an idle connection's empty buffer: a send that cannot take it whole is an error."""
        assert not self.closed, "send on a closed channel"
        self.buffer.clear()
        self.whole_at = -1
        self.waiter = asyncio.get_running_loop().create_future()
        self.sock.sendall(request)
        self.sent = time.monotonic()
        return self.waiter

    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(_TIMESPEC.size))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancillary = b"", []
        read = time.monotonic()
        if not data:
            return self.close(ConnectionResetError("closed without an answer"))
        self.buffer += data
        if self.whole_at < 0 and (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            length = _CONTENT_LENGTH.search(self.buffer, 0, end)
            self.whole_at = end + 4 + (int(length.group(1)) if length else 0)
        if 0 <= self.whole_at <= len(self.buffer) and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((bytes(self.buffer[: self.whole_at]), _arrival(ancillary, read), read))

    def close(self, error: Exception | None = None) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().remove_reader(self.sock)
            self.sock.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error or ConnectionResetError("closed"))


# Linux's SO_TIMESTAMPNS (Python's socket module does not name it): each read's ancillary data
# carries the kernel's receive time of its last bytes, on the wall clock, as a struct timespec.
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("qq")


def _arrival(ancillary: list[tuple[int, int, bytes]], read: float) -> float:
    """The receive stamp of a read's ancillary data on the monotonic clock; ``read`` without one."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            seconds, nanoseconds = _TIMESPEC.unpack_from(data)
            return seconds + nanoseconds / 1e9 - (time.time() - time.monotonic())
    return read


_CONTENT_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")


class Senders:
    """One asyncio loop driving many groups: each heartbeats and asks for quorums like a group leader."""

    def __init__(self, plan: Plan, groups: list[str]) -> None:
        self.plan = plan
        self.groups = groups
        host, port = plan.url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in authorization_header(plan.token).items())
        self.asks: list[Ask] = []
        self.beats: list[float] = []  # heartbeat round trips (s)
        self.errors: dict[str, int] = {}
        self.counts = {"lane watches answered": 0, "commits allowed": 0, "commits refused": 0, "connections": 0}
        self.rng = random.Random(hash(tuple(groups)) & 0xFFFF)
        self.idle: dict[str, list[_Channel]] = {}  # each group's kept-alive connections with no request in them
        self._grants: dict[bytes, Any] = {}  # the current round's grants' bytes (with or without participants)
        self._quorums: dict[int, Any] = {}  # each quorum id's participants, as a full grant named them
        self.signed: dict[str, float] = {}  # each group's last request the lighthouse takes as a heartbeat
        self.config_digest = config_digest(plan.config)

    async def post(self, group: str, path: str, payload: dict[str, Any]) -> Answer:
        """One POST on one of ``group``'s idle connections, or a new one (see the module docstring)."""
        body = json.dumps(payload).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"{self.headers}Content-Length: {len(body)}\r\n\r\n"
        )
        request = head.encode() + body
        if path in SIGNS_OF_LIFE:
            self.signed[group] = time.monotonic()
        idle = self.idle.setdefault(group, [])
        while idle:
            channel = idle.pop()
            if not channel.closed:
                try:
                    return await self.exchange(group, channel, request)
                except ConnectionError:  # closed by the lighthouse as the request went out: once more
                    break
        channel = await _Channel.open(self.host, self.port)
        self.counts["connections"] += 1
        return await self.exchange(group, channel, request)

    async def exchange(self, group: str, channel: _Channel, request: bytes) -> Answer:
        try:
            raw, received, read = await channel.send(request)
        except BaseException:  # cancelled (the group died), or the connection failed: it carries nothing more
            channel.close()
            raise
        head, _, body = raw.partition(b"\r\n\r\n")
        if b"connection: close" in head.lower():
            channel.close()
        else:
            self.idle.setdefault(group, []).append(channel)
        return Answer(int(head.split(b" ", 2)[1]), body, channel.sent, received, read)

    def close(self, group: str) -> None:
        """A group's process died: its connections close with it."""
        for channel in self.idle.pop(group, []):
            channel.close()

    def grant(self, body: bytes) -> Any:
        """The quorum of a grant's bytes, parsed once per round and form: every participant gets the same
        bytes, and parsing each of 500 grants naming 1,000 groups held the sender's loop for half a second
        a round, its answers' arrival times noted that much late (real groups each parse their own). A
        grant without participants takes them from the quorum of that id a grant with them named."""
        if body not in self._grants:
            data = json.loads(body)
            quorum = quorum_answer_from_json(data, self._quorums.get(data["quorum"]["quorum_id"])).quorum
            self._quorums[quorum.quorum_id] = quorum
            if any(q.round_id != quorum.round_id for q in self._grants.values()):
                self._grants = {}  # a new round: the last one's bytes come no more
            self._grants[body] = quorum
        return self._grants[body]

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    async def heartbeats(self, group: str, state: dict[str, int]) -> None:
        """Beat ``heartbeat_s`` after the last answer, or after an ask or commit that went out since
        (the lighthouse takes it as a beat), as the manager's heartbeat thread does."""
        await asyncio.sleep(self.rng.uniform(0, self.plan.heartbeat_s))
        while True:
            if (due := self.signed.get(group, 0.0) + self.plan.heartbeat_s - time.monotonic()) > 0:
                await asyncio.sleep(due)
                continue
            progress = GroupProgress(
                inner_step=state["inner"], train_loss=4.0 / (1 + state["inner"] / 500), tokens_per_s=12345.0
            )
            beat = Heartbeat(
                self.plan.job, SIGNATURE, group, step=state["step"], quorum_id=state["qid"], progress=progress.to_json()
            )
            try:
                answer = await asyncio.wait_for(self.post(group, Heartbeat.path, beat.to_json()), 10.0)
                if answer.status == 200:
                    self.beats.append(answer.received - answer.sent)
                else:
                    self.error(f"heartbeat {answer.status}")
            except (OSError, asyncio.TimeoutError) as e:
                self.error(f"heartbeat {type(e).__name__}")
            state["inner"] += 5
            await asyncio.sleep(self.plan.heartbeat_s)

    async def ask(self, group: str, state: dict[str, int], watches: set) -> None:
        """One quorum long poll; a grant moves the group to the round after the quorum's."""
        plan = self.plan
        ask = QuorumAsk(
            plan.job,
            SIGNATURE,
            group,
            step=state["step"],
            commit_failed=False,
            timeout_s=plan.quorum_timeout_s,
            round_step=50 * state["step"],
            quorum_id=state["qid"],
            config={} if state["qid"] else plan.config,  # in full until granted, as the client sends it
            known_quorum=state["qid"],
            config_digest=self.config_digest,
        )
        try:
            answer = await self.post(group, QuorumAsk.path, ask.to_json())
        except OSError as e:
            return self.error(f"quorum {type(e).__name__}")
        if answer.status != 200:
            return self.error(f"quorum {answer.status}")
        quorum = self.grant(answer.body)
        self.asks.append(
            Ask(
                group,
                answer.sent,
                answer.received,
                quorum.quorum_id,
                quorum.max_step,
                len(quorum.participants),
                answer.read,
            )
        )
        state["qid"] = quorum.quorum_id
        await self.round_calls(group, state, quorum, watches)

    async def round_calls(self, group: str, state: dict[str, int], quorum: Any, watches: set) -> None:
        """The round after a grant: the all-reduce and the commit, the group's lane watch beside them."""
        watch, commit = ENDPOINTS.get(LANE_WATCH_PATH), ENDPOINTS.get(COMMIT_PATH)
        round_id = state["round"] = getattr(quorum, "round_id", 0)
        if watch is not None and not watches:
            task = asyncio.create_task(self.lane_watch(group, state, watch))
            watches.add(task)
            task.add_done_callback(watches.discard)
        await asyncio.sleep(ALL_REDUCE_S)
        step = quorum.max_step + 1
        if commit is not None:
            request = commit(self.plan.job, SIGNATURE, group, round_id=round_id, step=step)
            try:
                answer = await self.post(group, COMMIT_PATH, request.to_json())
            except OSError as e:
                return self.error(f"commit {type(e).__name__}")
            if answer.status != 200:
                return self.error(f"commit {answer.status}")
            if json.loads(answer.body).get("broken"):
                self.counts["commits refused"] += 1
                return  # not committed: the group stays behind and heals at its next round
            self.counts["commits allowed"] += 1
        state["step"] = step

    async def lane_watch(self, group: str, state: dict[str, int], watch: type) -> None:
        """The group's lane watch, held across its rounds as ``LaneWatcher`` holds it: posted again
        only once answered (a member left the group's round, or the wait ran out)."""
        news = (0, 0)  # (round id, members gone from it) last heard
        while True:
            round_id = state["round"]
            if news[0] > round_id:  # its next round's news came before its grant: wait for the grant
                await asyncio.sleep(ALL_REDUCE_S)
                continue
            seen = news[1] if news[0] == round_id else 0
            request = watch(
                self.plan.job, SIGNATURE, group, round_id=round_id, timeout_s=self.plan.quorum_timeout_s, gone_seen=seen
            )
            try:
                answer = await self.post(group, LANE_WATCH_PATH, request.to_json())
            except OSError as e:
                return self.error(f"lane watch {type(e).__name__}")
            if answer.status != 200:
                return self.error(f"lane watch {answer.status}")
            self.counts["lane watches answered"] += 1
            body = json.loads(answer.body)
            news = max(news, (body["round_id"], len(body["gone"])))

    async def group(self, group: str, fresh: bool) -> None:
        """A group's life: heartbeats in the background, an ask at each window (a fresh process asks at once)."""
        plan = self.plan
        state = {"step": 0, "qid": 0, "inner": 0, "round": 0}
        beating = asyncio.create_task(self.heartbeats(group, state))
        watches: set[asyncio.Task] = set()
        try:
            if fresh:
                await self.ask(group, state, watches)
            for k in range(plan.rounds + 1):
                at = plan.rounds_at + k * plan.window_s + self.rng.uniform(0, plan.spread_s)
                if at < time.monotonic():
                    continue
                await asyncio.sleep(at - time.monotonic())
                await self.ask(group, state, watches)
            await asyncio.sleep(max(0.0, plan.end - time.monotonic()))
        finally:
            beating.cancel()
            for task in list(watches):
                task.cancel()

    async def life(self, group: str) -> None:
        """The group, killed at its death time and replaced (a fresh process of it) ``REJOIN_S`` later."""
        await asyncio.sleep(max(0.0, self.plan.start - time.monotonic()))
        dies = self.plan.deaths.get(group)
        if dies is None:
            return await self.group(group, fresh=False)
        try:
            await asyncio.wait_for(self.group(group, fresh=False), dies - time.monotonic())
        except asyncio.TimeoutError:
            pass
        self.close(group)
        notice = RecoveryNotice(self.plan.job, SIGNATURE, group, wait_ms=0)  # the launcher: go on without it
        answer = await self.post("launcher", RecoveryNotice.path, notice.to_json())
        if answer.status != 200:
            self.error(f"recovery {answer.status}")
        await asyncio.sleep(REJOIN_S)
        await self.group(group, fresh=True)

    async def run(self) -> None:
        lives = [asyncio.create_task(self.life(g)) for g in self.groups]
        await asyncio.wait(lives, timeout=self.plan.end - time.monotonic() + 5)
        for task in lives:
            task.cancel()


def prioritize(pid: int, nice: int) -> None:
    """Run ``pid`` (0: this process) at ``nice``, and its session's scheduling group too: where the
    kernel groups tasks by session (autogroup), a process's nice counts only inside its session."""
    if nice:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        autogroup = Path(f"/proc/{pid or 'self'}/autogroup")
        if autogroup.exists():
            autogroup.write_text(str(nice))


def pin(pid: int, cpus: set[int]) -> None:
    """Run every thread of process ``pid`` (0: this one) on ``cpus`` only; threads it starts later
    inherit it. No-op for an empty set."""
    if not cpus:
        return
    for task in Path(f"/proc/{pid or 'self'}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _senders_main(plan: Plan, groups: list[str], conn: Any, nice: int, cpus: set[int]) -> None:
    prioritize(0, nice)
    pin(0, cpus)
    senders = Senders(plan, groups)
    began, cpu = time.monotonic(), time.process_time()
    asyncio.run(senders.run())
    share = (time.process_time() - cpu) / (time.monotonic() - began)
    conn.send(
        {
            "asks": [asdict(a) for a in senders.asks],
            "beats": senders.beats,
            "errors": senders.errors,
            "counts": senders.counts,
            "cpu": share,
        }
    )
    conn.close()


# -- the lighthouse process and what it costs ----------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int) -> dict[str, float]:
    """Resident memory now and at its peak (VmRSS, VmHWM), MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values


class Fetcher(threading.Thread):
    """GET ``url`` every ``every_s`` until stopped, timing each answer (the launcher's watch, a browser)."""

    def __init__(self, url: str, every_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.seconds: list[float] = []
        self.sizes: list[int] = []
        self.stop = threading.Event()
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            began = time.monotonic()
            try:
                with self.opener.open(self.url, timeout=30) as answer:
                    self.sizes.append(len(answer.read()))
                self.seconds.append(time.monotonic() - began)
            except OSError:
                self.seconds.append(float("inf"))


def wait_serving(url: str, pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while serving_pid(url) != pid:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the lighthouse did not serve at {url} within {timeout_s:g} s")
        time.sleep(0.1)


def run_scale(groups: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One load run against a fresh lighthouse process; the measured numbers."""
    job = resolve_lighthouse(compose_job([f"cluster.groups={groups}", "cluster.min_groups=1"]))
    run_dir = root / f"groups-{groups}"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "job.json").write_text(json.dumps(to_dict(job)))
    lifeline = Lifeline()
    lighthouse = exec_lighthouse(run_dir, SIGNATURE, run_dir / "logs" / "lighthouse.log", lifeline)
    prioritize(lighthouse.pid, args.nice)  # before it starts a thread: they inherit it
    pin(lighthouse.pid, args.lighthouse_cpus)
    url = f"http://{job.cluster.lighthouse.host}:{job.cluster.lighthouse.port}"
    try:
        wait_serving(url, lighthouse.pid)
        pin(lighthouse.pid, args.lighthouse_cpus)  # any thread started before the first pin took
        return measure(job, url, lighthouse.pid, groups, args)
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
        lifeline.cut()


def measure(job: Any, url: str, pid: int, groups: int, args: argparse.Namespace) -> dict[str, Any]:
    timeouts = job.cluster.timeouts
    now = time.monotonic()
    start = now + 2.0
    plan = Plan(
        url=url,
        token=job.cluster.lighthouse.token,
        job=job.name,
        config=training_config(job),
        heartbeat_s=timeouts.heartbeat / HEARTBEATS_PER_TIMEOUT,
        quorum_timeout_s=timeouts.quorum,
        start=start,
        rounds_at=start + args.heartbeats_only,
        window_s=args.window,
        spread_s=args.spread,
        rounds=args.rounds,
    )
    names = [f"group-{i}" for i in range(groups)]
    rng = random.Random(groups)
    death_window = (plan.rounds_at + plan.window_s, plan.end - 2 * plan.window_s - REJOIN_S)
    plan.deaths = {g: rng.uniform(*death_window) for g in rng.sample(names, args.deaths)}
    pipes, processes = [], []
    context = multiprocessing.get_context("fork")
    for i in range(args.senders):
        ours, theirs = context.Pipe(duplex=False)
        process = context.Process(
            target=_senders_main,
            args=(plan, names[i :: args.senders], theirs, args.nice, args.others_cpus),
            daemon=True,
        )
        process.start()
        pipes.append(ours)
        processes.append(process)
    watch = Fetcher(url + "/alive", WATCH_EVERY_S)
    status, page = Fetcher(url + "/status", PAGE_EVERY_S), Fetcher(url + "/", PAGE_EVERY_S)
    marks = {}
    for name, at in (
        ("hb_from", start + 2.0),
        ("hb_to", plan.rounds_at),
        ("load_from", plan.rounds_at + plan.window_s),
    ):
        time.sleep(max(0.0, at - time.monotonic()))
        marks[name] = (time.monotonic(), cpu_seconds(pid))
        if name == "hb_to":
            for fetcher in (watch, status, page):
                fetcher.start()
    time.sleep(max(0.0, plan.end - time.monotonic()))
    marks["load_to"] = (time.monotonic(), cpu_seconds(pid))
    memory = memory_mb(pid)
    for fetcher in (watch, status, page):
        fetcher.stop.set()
    results = [p.recv() for p in pipes]
    for process in processes:
        process.join(timeout=30)
    formed = formation_times(url)
    asks = [Ask(**a) for r in results for a in r["asks"]]
    errors: dict[str, int] = {}
    for r in results:
        for kind, n in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    beats = [b for r in results for b in r["beats"]]
    counts = {k: sum(r["counts"][k] for r in results) for k in results[0]["counts"]}

    def share(a: str, b: str) -> float:
        (t0, c0), (t1, c1) = marks[a], marks[b]
        return (c1 - c0) / (t1 - t0)

    steady_after = plan.rounds_at + plan.window_s / 2
    latencies = quorum_latencies(asks, after=steady_after)
    return {
        "groups": groups,
        "rounds": len({(a.quorum_id, a.max_step) for a in asks if a.asked > steady_after}),
        "answers": len(latencies),
        "quorum_p50_ms": 1000 * percentile(latencies, 50),
        "quorum_p99_ms": 1000 * percentile(latencies, 99),
        "quorum_max_ms": 1000 * max(latencies, default=float("nan")),
        "quorum_read_p99_ms": 1000 * percentile(quorum_latencies(asks, after=steady_after, read=True), 99),
        "heartbeats_per_s": len(beats) / (plan.end - plan.start),
        "heartbeat_p99_ms": 1000 * percentile(beats, 99),
        "cpu_heartbeats": share("hb_from", "hb_to"),
        "cpu_load": share("load_from", "load_to"),
        "rss_mb": memory.get("VmRSS", float("nan")),
        "peak_rss_mb": memory.get("VmHWM", float("nan")),
        "alive_ms": 1000 * max(watch.seconds, default=float("nan")),
        "status_s": max(status.seconds, default=float("nan")),
        "status_median_s": percentile(status.seconds, 50),
        "status_kb": max(status.sizes, default=0) / 1024,
        "page_s": max(page.seconds, default=float("nan")),
        "page_kb": max(page.sizes, default=0) / 1024,
        "deaths": args.deaths,
        "per_round": round_summaries(asks, after=steady_after, formed=formed),
        "senders_cpu": sum(r["cpu"] for r in results),
        "machine_load": os.getloadavg()[0],  # runnable processes on the machine: a shared one delays everything
        "round_calls": counts,
        "errors": errors,
    }


# -- numbers and the table ---------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the nearest ranks; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def steady_rounds(asks: list[Ask], after: float) -> list[list[Ask]]:
    """Each round's answers, in the order the rounds formed (asks made after ``after``, the start round excluded).

    A round is one quorum's answers (its id and max step); its last ask is the latest ask
    among the answers it received, so a group that asked for it and was left out counts
    in the round it did join.
    """
    rounds: dict[tuple[int, int], list[Ask]] = {}
    for a in asks:
        rounds.setdefault((a.quorum_id, a.max_step), []).append(a)
    steady = [answers for answers in rounds.values() if min(a.asked for a in answers) > after]
    return sorted(steady, key=lambda answers: min(a.answered for a in answers))


def quorum_latencies(asks: list[Ask], after: float, read: bool = False) -> list[float]:
    """Each answer's delay after the last ask of its round (see ``steady_rounds``): until it
    reached the group's socket, or (``read``) until the sender read it."""
    latencies = []
    for answers in steady_rounds(asks, after):
        last = max(a.asked for a in answers)
        latencies += [(a.read if read and a.read is not None else a.answered) - last for a in answers]
    return latencies


class Formed(NamedTuple):
    """When the lighthouse formed a round and handed its last grant to a socket (monotonic s)."""

    at: float
    sent: float | None


def formation_times(url: str) -> dict[tuple[int, int], Formed]:
    """When the lighthouse formed each recent quorum and sent its last grant (/status's history),
    by (quorum id, max step), on this process's monotonic clock: wall minus monotonic time is the
    same in every process of the machine, so the offset taken here moves the history's wall stamps
    onto the asks' clock."""
    with urllib.request.urlopen(url + "/status", timeout=30) as answer:
        history = json.loads(answer.read())["history"]
    offset = time.time() - time.monotonic()
    return {
        (q["quorum_id"], q["max_step"]): Formed(
            q["formed_at"] - offset, None if q.get("grants_sent_at") is None else q["grants_sent_at"] - offset
        )
        for q in history
    }


def round_summaries(
    asks: list[Ask], after: float, formed: dict[tuple[int, int], Formed] | None = None
) -> list[dict[str, float]]:
    """Per round: its answers, how long its asks took to come in, its answers' delays (ms) and,
    where ``formed`` has it, when the lighthouse formed it and sent its last grant (ms after the
    last ask): a round sent at once whose answers came late was late in the groups' reading."""
    summaries = []
    for answers in steady_rounds(asks, after):
        last = max(a.asked for a in answers)
        delays = [a.answered - last for a in answers]
        summary = {
            "answers": len(answers),
            "last_ask": last,  # on the shared monotonic clock: to line a round up with the lighthouse's log
            "asks_over_s": last - min(a.asked for a in answers),
            "p50_ms": 1000 * percentile(delays, 50),
            "max_ms": 1000 * max(delays),
        }
        if reads := [a.read for a in answers if a.read is not None]:
            summary["read_max_ms"] = 1000 * (max(reads) - last)
        if (stamps := (formed or {}).get((answers[0].quorum_id, answers[0].max_step))) is not None:
            summary["formed_ms"] = 1000 * (stamps.at - last)
            if stamps.sent is not None:
                summary["sent_ms"] = 1000 * (stamps.sent - last)
        summaries.append(summary)
    return summaries


HEADERS = [
    "groups",
    "rounds",
    "quorum p50 / p99 ms",
    "read p99 ms",
    "heartbeats/s",
    "heartbeat p99 ms",
    "CPU: heartbeats only",
    "CPU: whole load",
    "peak RSS MiB",
    "/alive ms (max)",
    "/status s (max)",
    "page s (max)",
    "errors",
]


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            f"{r['groups']:,}",
            str(r["rounds"]),
            f"{r['quorum_p50_ms']:.1f} / {r['quorum_p99_ms']:.1f}",
            f"{r['quorum_read_p99_ms']:.1f}",
            f"{r['heartbeats_per_s']:,.0f}",
            f"{r['heartbeat_p99_ms']:.1f}",
            f"{100 * r['cpu_heartbeats']:.0f}%",
            f"{100 * r['cpu_load']:.0f}%",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['alive_ms']:.1f}",
            f"{r['status_s']:.3f} ({r['status_kb']:,.0f} KiB)",
            f"{r['page_s']:.3f} ({r['page_kb']:,.0f} KiB)",
            str(sum(r["errors"].values())),
        ]
        for r in runs
    ]


def targets(run: dict[str, Any]) -> list[str]:
    """The targets (``TARGET_*``), checked on the largest run."""
    n = f"{run['groups']:,} groups"
    return [
        f"- quorum p99 within {TARGET_P99_MS:g} ms at {n}: {run['quorum_p99_ms']:.1f} ms: "
        + verdict(run["quorum_p99_ms"] <= TARGET_P99_MS),
        f"- the lighthouse under {TARGET_CPU:g} of a core at {n}: {run['cpu_load']:.2f}: "
        + verdict(run["cpu_load"] < TARGET_CPU),
        f"- the status page under {TARGET_PAGE_S:g} s at {n}: {run['page_s']:.3f} s: "
        + verdict(run["page_s"] < TARGET_PAGE_S),
    ]


def _cpus(cpus: set[int]) -> str:
    return ", ".join(map(str, sorted(cpus)))


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    settings = (
        f"window {args.window:g} s, asks spread over {args.spread:g} s, {args.rounds} rounds, "
        f"{args.deaths} deaths (each announced, back {REJOIN_S:g} s later), {args.senders} sender processes"
    )
    if args.lighthouse_cpus:
        settings += f"; the lighthouse on CPU {_cpus(args.lighthouse_cpus)}, the senders on {_cpus(args.others_cpus)}"
    errors = {k: n for r in runs for k, n in r["errors"].items()}
    lines = [
        (
            f"The lighthouse process against simulated groups on loopback ({settings}); quorum latency is "
            "from a round's last ask until each answer reached its group's socket (the kernel's receive stamp), "
            "read p99 until the senders had read them; CPU is the lighthouse process's own, as a share of one core."
        ),
        "",
        markdown_table(HEADERS, table_rows(runs)),
        "",
        *targets(max(runs, key=lambda r: r["groups"])),
    ]
    loads = ", ".join(f"{r['machine_load']:.0f}" for r in runs if "machine_load" in r)
    if loads:
        lines += ["", f"Machine load average (1 min) at the end of each run: {loads} (on {os.cpu_count()} cores)."]
    if errors:
        lines += ["", "errors: " + ", ".join(f"{k} x{n}" for k, n in sorted(errors.items()))]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 groups, 4 rounds: a smoke test")
    parser.add_argument("--groups", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--rounds", type=int, default=12, help="rounds after the start round")
    parser.add_argument("--window", type=float, default=5.0, help="seconds between a group's quorum asks")
    parser.add_argument("--spread", type=float, default=0.5, help="the groups' asks of one round spread over this")
    parser.add_argument("--deaths", type=int, default=4, help="groups killed (and replaced) during the rounds")
    parser.add_argument("--heartbeats-only", type=float, default=8.0, help="seconds of heartbeats before any ask")
    parser.add_argument("--senders", type=int, default=2, help="processes simulating the groups")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="scheduling priority of the lighthouse and the senders, their sessions' too (negative, as root: "
        "a machine shared with other work then delays neither; the CPU measured is the lighthouse's own either way)",
    )
    parser.add_argument(
        "--lighthouse-cpus",
        type=int,
        nargs="+",
        default=[],
        help="run the lighthouse on these CPUs and the senders on the rest: "
        "the lighthouse on a host of its own, as a real job runs it, without the senders taking its core",
    )
    add_output_arguments(parser)
    args = parser.parse_args()
    ours = os.sched_getaffinity(0)
    args.lighthouse_cpus = set(args.lighthouse_cpus)
    args.others_cpus = ours - args.lighthouse_cpus if args.lighthouse_cpus else set()
    if args.lighthouse_cpus and (not args.others_cpus or not args.lighthouse_cpus <= ours):
        parser.error(f"--lighthouse-cpus must be some, not all, of this process's CPUs {_cpus(ours)}")
    if args.quick:
        args.groups, args.rounds, args.deaths, args.heartbeats_only, args.window = [100], 4, 2, 2.0, 2.0
    stop_on_sigterm()
    runs = []
    with runs_root(args.keep_runs, "lighthouse_scale") as root:
        for groups in args.groups:
            print(f"{groups} groups ...", file=sys.stderr, flush=True)
            runs.append(run_scale(groups, args, root))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    text = report(runs, args)
    print(text)
    write_result("lighthouse_scale.json", json.dumps(runs, indent=2), args.results)
    print(f"table written to {write_result('lighthouse_scale.md', text, args.results)}", file=sys.stderr)


if __name__ == "__main__":
    main()
