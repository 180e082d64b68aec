"""The lighthouse: one per job, it decides which replica groups take part in each outer sync.

Group leaders speak plain HTTP + JSON to it (standard library only; nothing received is ever
unpickled, DESIGN.md invariant 5). Heartbeats carry a group's committed step and the last
quorum id it saw; a quorum request is a long poll, answered once the pure ``QuorumBook``
(quorum.py) forms a quorum that contains the group. The lighthouse also hosts the job's
``TCPStore``, on which the outer lanes rendezvous, and a read-only status page for operators
(the HTTP front is http_front.py). A round watch (time-bounded windows) is a long poll too; a
recovery notice from the launcher says whether rounds wait for a dead group's replacement.
Its whole memory is rebuilt from heartbeats, so a restarted lighthouse needs no saved state.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from diloco.config.cluster import LighthouseConfig, QuorumRules
from diloco.ft import status_page
from diloco.ft.http_front import LighthouseHTTPServer
from diloco.ft.identity import JobIdentity, NotThisJob
from diloco.ft.protocol import (
    HEARTBEAT_ACK,
    ErrorAnswer,
    ErrorCode,
    GroupProgress,
    Heartbeat,
    LaneWatch,
    LighthouseRefused,
    QuorumAsk,
    QuorumGrant,
    RecoveryNotice,
    RoundCommit,
    RoundNews,
    RoundWatch,
    check_token,
    parse_request,
    quorum_answer_to_json,
)
from diloco.ft.quorum import JobEnd, Quorum, QuorumBook, QuorumRequest

log = logging.getLogger(__name__)

MAX_POLL_S = 300.0  # a long poll never outlives this, whatever the client asks for
DECIDE_EVERY_S = 0.02  # the join and heartbeat timeouts are noticed within this
_WILDCARD_HOSTS = {"", "0.0.0.0"}


@dataclass
class _Waiter:
    """One open long poll; the decision step fills in ``quorum``, ``end`` or ``error`` and wakes it."""

    group: str
    quorum: Quorum | None = None
    end: JobEnd | None = None
    error: ErrorAnswer | None = None

    @property
    def answered(self) -> bool:
        return self.quorum is not None or self.end is not None or self.error is not None


class Lighthouse:
    """Membership and quorums for one job, served over HTTP; see the module docstring."""

    def __init__(
        self,
        cfg: LighthouseConfig,
        rules: QuorumRules,
        job_id: str,
        model_signature: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        job_config: dict[str, Any] | None = None,
    ) -> None:
        cfg.validate()
        cfg.check_bind()
        rules.validate()
        self.cfg = cfg
        self.rules = rules
        self.job_id = job_id
        self._identity = JobIdentity(job_id, model_signature, job_config)  # None parts: pinned by the first group
        self._clock = clock
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # round watchers and stop() wait on it
        # Open quorum requests wait on their own condition, woken only when a request is answered:
        # woken by every ask (for the round watchers), 1,000 waiting groups cost a million wake-ups
        # a round and answered the last ask 0.75 s late at 300 groups (experiments/lighthouse_scale.py).
        self._answered = threading.Condition(lock)
        self._book = QuorumBook(rules, started_at=clock())
        self._told_end: set[str] = set()  # finished groups that received the job's end
        self._steps: dict[str, int] = {}
        self._waiters: dict[str, _Waiter] = {}
        # Open lane watches by group: each wakes only when its own group's round breaks or ends,
        # so a thousand watchers are not woken by every ask (the quorum waiters' condition is).
        self._lane_watchers: dict[str, set[threading.Event]] = {}
        self._current: tuple[Quorum, float] | None = None  # (quorum, formed at clock time)
        self._history: deque[dict[str, Any]] = deque(maxlen=cfg.history)
        self._board = status_page.StatusBoard()  # what only the status page shows
        self._stopping = threading.Event()
        # An ask wakes the decide loop instead of running the rules itself: each decision is a pass over
        # every group, and 1,000 asks a round, each deciding under the lock, queued the last ask 1.5 s
        # (experiments/lighthouse_scale.py); the loop decides once for all the asks that came meanwhile.
        self._decide_now = threading.Event()
        self._grant_cache: tuple[Quorum, tuple[str, int], bytes] | None = None
        self._server: LighthouseHTTPServer | None = None
        self._store: dist.TCPStore | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError(f"lighthouse already serving at {self.url}")
        self._stopping.clear()
        self._store = _host_store(self.cfg.host, self.cfg.store_port)
        try:
            self._server = LighthouseHTTPServer((self.cfg.host, self.cfg.port))
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
            self._answered.notify_all()
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
    ) -> tuple[int, dict | bytes]:
        """Check and serve one POST to an ``ENDPOINTS`` path; a refusal changes nothing in the lighthouse's state.

        The answer is a JSON object, or (a quorum grant) its encoded bytes.
        """
        try:
            check_token(authorization, self.cfg.token)
            request = parse_request(path, body)
            config = request.config if isinstance(request, QuorumAsk) else None
            with self._cond:
                try:
                    self._identity.admit(request.job, request.signature, config)
                except NotThisJob as refusal:
                    raise LighthouseRefused(ErrorCode.WRONG_JOB, str(refusal)) from None
        except LighthouseRefused as refusal:
            log.warning("refused %s from %s (%s): %s", path, peer, refusal.code.value, refusal)
            return refusal.status, ErrorAnswer(refusal.code, str(refusal)).to_json()
        if isinstance(request, Heartbeat):
            self._heartbeat(request)
            return 200, HEARTBEAT_ACK
        if isinstance(request, RoundWatch):
            return 200, {"round_step": self._round_open(request)}
        if isinstance(request, RecoveryNotice):
            self._recovery(request)
            return 200, HEARTBEAT_ACK
        if isinstance(request, LaneWatch):
            return 200, self._lane_watch(request).to_json()
        if isinstance(request, RoundCommit):
            return 200, self._commit(request).to_json()
        assert isinstance(request, QuorumAsk), f"no handler for {type(request).__name__} at {path}"
        answer = self._quorum(request, local_host if self.cfg.host in _WILDCARD_HOSTS else self.cfg.host)
        if isinstance(answer, ErrorAnswer):
            return answer.status, answer.to_json()
        if isinstance(answer, JobEnd):
            return 200, quorum_answer_to_json(answer)
        return 200, self._grant_bytes(answer)

    def _grant_bytes(self, grant: QuorumGrant) -> bytes:
        """A grant's JSON, encoded once per quorum: every participant gets the same bytes, and encoding
        1,000 participants' names for each of 1,000 groups cost a second a round (issue 33)."""
        cached = self._grant_cache
        if cached is None or cached[0] is not grant.quorum or cached[1] != grant.store:
            cached = (grant.quorum, grant.store, json.dumps(quorum_answer_to_json(grant)).encode())
            self._grant_cache = cached  # one assignment: a thread that races here encodes it once more
        return cached[2]

    def _heartbeat(self, beat: Heartbeat) -> None:
        with self._cond:
            self._book.heartbeat(
                beat.group, self._clock(), quorum_id_seen=beat.quorum_id, step=beat.step, finished=beat.finished
            )
            self._steps[beat.group] = beat.step
            self._board.progress(beat.group, GroupProgress.from_json(beat.progress))

    def _recovery(self, notice: RecoveryNotice) -> None:
        with self._cond:
            now = self._clock()
            if notice.wait_ms:
                self._book.await_return(notice.group, now, notice.wait_ms / 1000)
            else:
                self._book.depart(notice.group)
            self._decide_locked(now)

    def _lane_watch(self, watch: LaneWatch) -> RoundNews:
        """Wait (at most ``watch.timeout_s``, capped by ``MAX_POLL_S``) until more members leave the group's round
        than it knows of, or the group leaves it."""
        woken = threading.Event()
        with self._cond:
            deadline = self._clock() + min(watch.timeout_s, MAX_POLL_S)
            self._lane_watchers.setdefault(watch.group, set()).add(woken)
        try:
            while True:
                with self._cond:
                    broken, still_in = self._book.round_state(watch.group, watch.round_id)
                    remaining = deadline - self._clock()
                news = (
                    RoundNews(broken.reason, tuple(sorted(broken.gone)), still_in)
                    if broken
                    else RoundNews(open=still_in)
                )
                if len(news.gone) > watch.gone_seen or not news.open or remaining <= 0 or self._stopping.is_set():
                    return news
                woken.wait(min(remaining, 0.5))
                woken.clear()
        finally:
            with self._cond:
                watchers = self._lane_watchers.get(watch.group, set())
                watchers.discard(woken)
                if not watchers:
                    self._lane_watchers.pop(watch.group, None)

    def _commit(self, commit: RoundCommit) -> RoundNews:
        with self._cond:
            reason = self._book.commit(commit.group, commit.round_id, commit.step, self._clock())
            if not reason:
                self._steps[commit.group] = commit.step
        if reason:
            log.warning("group %s may not commit round %d: %s", commit.group, commit.round_id, reason)
        return RoundNews(reason, open=False)  # only ``broken`` is read

    def _wake_lane_watchers(self, groups: Iterable[str]) -> None:
        for group in groups:
            for woken in self._lane_watchers.get(group, ()):
                woken.set()

    def _quorum(self, ask: QuorumAsk, store_host: str) -> QuorumGrant | JobEnd | ErrorAnswer:
        """Wait (at most ``ask.timeout_s``, capped by ``MAX_POLL_S``) for this request's fate."""
        group = ask.group
        waiter = _Waiter(group)
        with self._cond:
            now = self._clock()
            deadline = now + min(ask.timeout_s, MAX_POLL_S)
            if self._book.ended is not None:
                self._answer_after_end(waiter, ask.finished)
            else:
                self._book.heartbeat(group, now, quorum_id_seen=ask.quorum_id, finished=ask.finished)
                earlier = self._waiters.get(group)
                if earlier is not None:
                    earlier.error = ErrorAnswer(
                        ErrorCode.SUPERSEDED, f"superseded: group {group!r} sent a newer quorum request"
                    )
                    self._answered.notify_all()
                self._waiters[group] = waiter
                self._steps[group] = ask.step
                self._book.ask(
                    QuorumRequest(group, ask.step, ask.commit_failed, ask.finished, ask.digest, ask.round_step), now
                )
                self._wake_lane_watchers([group])  # it left its last round
                self._cond.notify_all()  # round watchers: a round may have opened
                self._decide_now.set()
            while not waiter.answered and not self._stopping.is_set():
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return ErrorAnswer(ErrorCode.TIMEOUT, self._give_up_locked(waiter, ask.timeout_s))
                self._answered.wait(min(remaining, 0.5))
            if waiter.quorum is not None:
                return QuorumGrant(waiter.quorum, (store_host, self.store_address[1]))
            if waiter.end is not None:
                return waiter.end
            if waiter.error is not None:
                return waiter.error
            self._give_up_locked(waiter, ask.timeout_s)
            return ErrorAnswer(ErrorCode.STOPPING, "the lighthouse is stopping; retry once it is back")

    def _round_open(self, watch: RoundWatch) -> int:
        """Wait (at most ``watch.timeout_s``, capped by ``MAX_POLL_S``) for a peer to open a later round."""
        position = (watch.step, watch.round_step)
        with self._cond:
            deadline = self._clock() + min(watch.timeout_s, MAX_POLL_S)
            while not self._stopping.is_set():
                if round_step := self._book.open_round(watch.group, position):
                    return round_step
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return 0
                self._cond.wait(min(remaining, 0.5))
            return 0

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
            f"of the healthy groups, after a join wait of {self._book.join_wait():.2g} s "
            f"(cluster.timeouts.join={self.rules.join_timeout_s:g} s, longer while groups ask far apart)"
        )

    def _answer_after_end(self, waiter: _Waiter, finished: bool) -> None:
        """After the end a finished group learns it; any other is too late to take part."""
        end = self._book.ended
        assert end is not None, "called only once the job has ended"
        if finished:
            waiter.end = end
            self._told_end.add(waiter.group)
        else:
            waiter.error = ErrorAnswer(
                ErrorCode.JOB_ENDED,
                f"the job ended at round {end.round} (every group finished, or cluster.timeouts.end passed after "
                f"the first did); group {waiter.group!r} did not finish and can no longer take part",
            )

    @property
    def ended(self) -> JobEnd | None:
        with self._cond:
            return self._book.ended

    def awaits_replacement(self, group: str) -> bool:
        """Whether rounds wait for ``group``'s replacement: a recovery notice said so, and its wait has not run out."""
        with self._cond:
            held = self._book.awaited.get(group)
            return held is not None and self._clock() < held[1]

    def wait_replies_sent(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no POST's answer is still being written; True if none is.

        A group is counted as told the job's end when its answer is decided, a moment before
        the answer is on the wire: a lighthouse that left then cut off groups that finished
        together (issue 33: 30 groups in lockstep), which then waited out their timeouts.
        """
        deadline = time.monotonic() + timeout_s
        while self._server is not None and self._server.posts_in_flight() > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def served_end(self) -> bool:
        """The job ended and every group that had finished by then has been told."""
        with self._cond:
            end = self._book.ended
            return end is not None and set(self._book.finished) <= self._told_end

    # -- decisions -----------------------------------------------------------------------
    def _decide_loop(self) -> None:
        while not self._stopping.is_set():
            self._decide_now.wait(DECIDE_EVERY_S)
            self._decide_now.clear()
            with self._cond:
                self._decide_locked(self._clock())

    def _decide_locked(self, now: float) -> None:
        """Run the pure rules once and wake every waiter whose fate they settled."""
        woken = False
        told = self._book.break_rounds(now)
        for reason in sorted(set(told.values())):
            log.warning("%s; its other members give it up", reason)
        self._wake_lane_watchers(told)
        quorum = self._book.decide(now)
        self._board.membership(self._book.healthy(now))
        if quorum is not None:
            self._current = (quorum, now)
            self._history.append({**quorum.to_json(), "formed_at": time.time()})
            self._board.quorum_formed(quorum)
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
        for group, reason in self._book.turned_away.items():
            waiter = self._waiters.pop(group, None)
            if waiter is not None:
                waiter.error = ErrorAnswer(ErrorCode.WITHDRAWN, f"request of group {group!r} withdrawn: {reason}")
                woken = True
        self._book.turned_away.clear()
        if self._book.ended is None and (end := self._book.end_of_job(now)) is not None:
            log.info("the job ended at round %d, held by %s", end.round, ", ".join(end.holders))
            self._board.event("end", "", f"round {end.round}, held by {', '.join(end.holders)}")
        if self._book.ended is not None:
            for group, waiter in list(self._waiters.items()):
                self._answer_after_end(waiter, group in self._book.finished)
                del self._waiters[group]
                woken = True
        if woken:
            self._answered.notify_all()

    # -- status --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What /status serves: a read-only snapshot, holding no secrets (the pid lets a launcher
        tell its own lighthouse from another process on the port)."""
        with self._cond:
            return {"pid": os.getpid()} | status_page.build_status(
                self.job_id,
                self._identity.signature,
                self._book,
                self._steps,
                self._current,
                self._history,
                self._clock(),
                self._board,
            )


def _host_store(host: str, port: int) -> dist.TCPStore:
    """The TCPStore the outer lanes rendezvous on; a port it cannot take is ``OSError`` naming the key and the fix."""
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    except RuntimeError as error:  # torch's DistNetworkError: several lines ending in "message: ..."
        text = str(error)
        reason = "address already in use" if "EADDRINUSE" in text else text.strip().splitlines()[-1]
        raise OSError(
            f"lighthouse cannot host its store on cluster.lighthouse.store_port={port} ({reason}); stop what "
            "listens there or pick another cluster.lighthouse.store_port (0 picks a free one)"
        ) from None


def serve_forever(
    cfg: LighthouseConfig,
    rules: QuorumRules,
    job_id: str,
    model_signature: str | None = None,
    job_config: dict[str, Any] | None = None,
) -> None:
    """Run a lighthouse until SIGINT or SIGTERM, or until its job has ended (call from the main thread).

    After the end it stays until every finished group has been told (at most
    ``rules.end_timeout_s``), then returns: exiting 0 means the job is over, so an
    orchestrator restarts the lighthouse only when it exits any other way. Stopped by a
    signal before the end, it exits 1 (``SystemExit`` with the reason): it is not done.
    """
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Lighthouse(cfg, rules, job_id, model_signature, job_config=job_config) as lighthouse:
            print(f"lighthouse for job {job_id!r} at {lighthouse.url}; status page {lighthouse.url}/", flush=True)
            ended_at = None
            while not done.wait(0.1):
                if ended_at is None and lighthouse.ended is not None:
                    ended_at = time.monotonic()
                if ended_at is not None and (
                    lighthouse.served_end() or time.monotonic() - ended_at > rules.end_timeout_s
                ):
                    lighthouse.wait_replies_sent(timeout_s=5.0)
                    print(f"job {job_id!r} ended at round {lighthouse.ended.round}; lighthouse exiting", flush=True)
                    return
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    sys.exit(f"lighthouse of job {job_id!r} stopped by a signal before the job ended")
