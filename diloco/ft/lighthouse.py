"""The lighthouse: one per job, it decides which replica groups take part in each outer sync.

Group leaders speak plain HTTP + JSON to it (standard library only; nothing received is ever
unpickled: docs/design.md, invariant 5). Heartbeats carry a group's committed step and the last
quorum id it saw; every sign of life (a heartbeat, quorum request or commit) carries what the
status page shows of the group. A quorum request is a long poll, answered once the pure
``QuorumBook`` (quorum.py) forms a quorum that contains the group. The lighthouse also hosts
the job's ``TCPStore``, on which the outer lanes rendezvous, and a read-only status page for
operators (the HTTP front is http_front.py), which it saves to a file as it stops. A round
watch (time-bounded windows) and a lane watch are long polls too; a recovery notice from the
launcher says whether rounds wait for a dead group's replacement. A long poll holds no thread:
it is parked with the HTTP front's ``Reply`` and answered by whichever step settles it (an
ask, a decision, its deadline, ``stop``). Its whole memory is rebuilt from heartbeats, so a
restarted lighthouse needs no saved state.
"""

from __future__ import annotations

import functools
import gc
import heapq
import itertools
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
from pathlib import Path
from typing import Any

import torch.distributed as dist

from diloco.config.cluster import LighthouseConfig, QuorumRules
from diloco.files import write_text_atomically
from diloco.ft import status_page
from diloco.ft.http_front import LighthouseHTTPServer, Reply
from diloco.ft.identity import JobIdentity, NotThisJob
from diloco.ft.protocol import (
    HEARTBEAT_ACK,
    ErrorAnswer,
    ErrorCode,
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
DECIDE_EVERY_S = 0.02  # the join, heartbeat and long polls' timeouts are noticed within this
# Deciding takes at most this share of a core (and waits at most DECIDE_EVERY_S between passes): a pass
# looks at every group, and at 1,000 groups a pass after each ask of a round's burst held the lock and
# the GIL from the HTTP loop, which left up to 1,000 connections waiting to be accepted and answered the
# last ask a second late.
DECIDE_SHARE = 0.1
_WILDCARD_HOSTS = {"", "0.0.0.0"}
_STOPPING = ErrorAnswer(ErrorCode.STOPPING, "the lighthouse is stopping; retry once it is back")
_ACK = json.dumps(HEARTBEAT_ACK).encode()  # encoded once: about 1,300 heartbeats a second at 1,000 groups


@dataclass(eq=False)
class _Poll:
    """One parked long poll (a quorum request, lane watch or round watch), answered exactly once."""

    request: QuorumAsk | LaneWatch | RoundWatch
    deadline: float  # on the lighthouse's clock
    reply: Reply
    store_host: str = ""  # a quorum grant's store address
    done: bool = False

    @property
    def group(self) -> str:
        return self.request.group

    def answer(self, status: int, payload: dict | bytes, written: Callable[[], None] | None = None) -> None:
        if not self.done:
            self.done = True
            self.reply(status, payload, written)


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
        # None parts: pinned by the first group; the group count is the lighthouse's own
        self._identity = JobIdentity(job_id, model_signature, job_config, groups=rules.expected_groups)
        self._clock = clock
        self._lock = threading.Lock()
        self._book = QuorumBook(rules, started_at=clock())
        self._told_end: set[str] = set()  # finished groups that received the job's end
        self._steps: dict[str, int] = {}
        self._waiters: dict[str, _Poll] = {}  # open quorum requests by group
        # Open lane watches by group: each is looked at only when a round of its group breaks, or its wait runs out.
        self._lane_watchers: dict[str, set[_Poll]] = {}
        self._round_watchers: set[_Poll] = set()  # looked at once per decision after asks came
        self._asked = False  # since the last decision
        self._deadlines: list[tuple[float, int, _Poll]] = []  # a heap; answered polls leave it lazily
        self._deadlines_kept = 0  # open polls at the heap's last sweep
        self._poll_ids = itertools.count()
        self._current: tuple[Quorum, float] | None = None  # (quorum, formed at clock time)
        self._history: deque[dict[str, Any]] = deque(maxlen=cfg.history)
        self._board = status_page.StatusBoard()  # what only the status page shows
        self._stopping = threading.Event()
        # An ask wakes the decide loop instead of running the rules itself: each decision is a pass over
        # every group, and 1,000 asks a round, each deciding under the lock, queued the last ask 1.5 s
        # (experiments/scale/lighthouse_scale.py); the loop decides once for all the asks that came meanwhile.
        self._decide_now = threading.Event()
        # The round's last ask skips the pause between passes: it waited up to DECIDE_EVERY_S for a round
        # that could form at once, 7-36 ms of a 1,000-group round's latency.
        self._decide_at_once = threading.Event()
        self._grant_cache: tuple[Quorum | None, dict[tuple[str, bool], bytes]] = (None, {})
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
        with self._lock:
            lanes = [poll for polls in self._lane_watchers.values() for poll in polls]
            for poll in [*self._waiters.values(), *lanes, *self._round_watchers]:
                self._finish_locked(poll, stopping=True)
            self._deadlines.clear()
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
        return self.cfg.url(self.port)

    @property
    def store_address(self) -> tuple[str, int]:
        if self._store is None:
            raise RuntimeError("lighthouse not started: call start() first")
        return self.cfg.host, int(self._store.port)

    # -- requests ------------------------------------------------------------------------
    def handle_post(
        self, path: str, authorization: str | None, body: bytes, local_host: str, peer: str, reply: Reply
    ) -> tuple[int, dict | bytes] | None:
        """Check and serve one POST to an ``ENDPOINTS`` path; a refusal changes nothing in the lighthouse's state.

        The answer is a JSON object, or (a quorum grant) its encoded bytes; ``None`` for a long
        poll left open, which ``reply`` answers later (from another thread, at most ``MAX_POLL_S`` on).
        """
        try:
            check_token(authorization, self.cfg.token)
            request = parse_request(path, body)
            config, digest = (request.config, request.config_digest) if isinstance(request, QuorumAsk) else (None, "")
            with self._lock:
                try:
                    self._identity.admit(request.job, request.signature, config, digest, request.group)
                except NotThisJob as refusal:
                    raise LighthouseRefused(ErrorCode.WRONG_JOB, str(refusal)) from None
        except LighthouseRefused as refusal:
            log.warning("refused %s from %s (%s): %s", path, peer, refusal.code.value, refusal)
            return refusal.status, ErrorAnswer(refusal.code, str(refusal)).to_json()
        if isinstance(request, Heartbeat):
            return 200, self._heartbeat(request, peer)
        if isinstance(request, RecoveryNotice):
            self._recovery(request)
            return 200, _ACK
        if isinstance(request, RoundCommit):
            return 200, self._commit(request).to_json()
        with self._lock:
            if isinstance(request, LaneWatch):
                return self._lane_watch_locked(request, reply)
            if isinstance(request, RoundWatch):
                return self._round_watch_locked(request, reply)
            assert isinstance(request, QuorumAsk), f"no handler for {type(request).__name__} at {path}"
            store_host = local_host if self.cfg.host in _WILDCARD_HOSTS else self.cfg.host
            self._reach_locked(request, peer)
            return self._quorum_locked(request, store_host, reply)

    def _grant_bytes(self, quorum: Quorum, store_host: str, known_quorum: int) -> bytes:
        """A grant's JSON, encoded once per quorum and form: every participant gets the same bytes, and
        encoding 1,000 participants' names for each of 1,000 groups cost a second a round.
        An asker that holds the quorum's participants (``QuorumAsk.known_quorum``) gets them left out."""
        if self._grant_cache[0] is not quorum:
            self._grant_cache = (quorum, {})
        form = (store_host, known_quorum == quorum.quorum_id)
        encoded = self._grant_cache[1].get(form)
        if encoded is None:
            grant = QuorumGrant(quorum, (store_host, self.store_address[1]))
            encoded = self._grant_cache[1][form] = json.dumps(grant.to_json(participants=not form[1])).encode()
        return encoded

    def _heartbeat(self, beat: Heartbeat, peer: str) -> bytes | dict:
        """The beat taken in; the answer asks the group to probe again the peers it stands cut from."""
        progress = beat.group_progress  # parsed when the request was read, outside the lock
        with self._lock:
            now = self._clock()
            self._book.heartbeat(beat.group, now, quorum_id_seen=beat.quorum_id, step=beat.step, finished=beat.finished)
            self._steps[beat.group] = beat.step
            self._board.progress(beat.group, progress)
            self._reach_locked(beat, peer)
            probe = self._book.reach.to_probe(beat.group, now)
        return {**HEARTBEAT_ACK, "probe": probe} if probe else _ACK

    def _reach_locked(self, message: Heartbeat | QuorumAsk, peer: str) -> None:
        """A leader's probe endpoint, on the address its request came from, and its probes since."""
        report = message.reach_report
        if report.port or report.reached or report.unreached or report.mbps or report.round_bytes:
            host = f"[{peer}]" if ":" in peer else peer
            before = set(self._book.reach.cut_since)
            now = self._clock()
            self._book.reach_report(
                message.group, host, report.port, report.reached, report.unreached, now, report.mbps, report.round_bytes
            )
            for cut in set(self._book.reach.cut_since) - before:
                self._board.event("cut", message.group, f"{' and '.join(sorted(cut))} cannot reach each other")
            if report.unreached and self._book.give_up_cut_rounds(message.group, now):
                self._decide_now.set()  # the round's other members stop waiting for its lane at once
            for whole in before - set(self._book.reach.cut_since):
                self._board.event("whole", message.group, f"{' and '.join(sorted(whole))} reach each other again")

    def _recovery(self, notice: RecoveryNotice) -> None:
        with self._lock:
            now = self._clock()
            if notice.wait_ms:
                self._book.await_return(notice.group, now, notice.wait_ms / 1000)
            else:
                self._book.depart(notice.group)
            self._decide_locked(now)

    def _park_locked(self, request: QuorumAsk | LaneWatch | RoundWatch, reply: Reply, store_host: str = "") -> _Poll:
        """A long poll left open until ``request.timeout_s`` (capped by ``MAX_POLL_S``) at most."""
        poll = _Poll(request, self._clock() + min(request.timeout_s, MAX_POLL_S), reply, store_host)
        heapq.heappush(self._deadlines, (poll.deadline, next(self._poll_ids), poll))
        return poll

    def _lane_watch_locked(self, watch: LaneWatch, reply: Reply) -> tuple[int, dict] | None:
        """Answered once more members leave the group's round than it knows of (see ``LaneWatch``)."""
        news, settled = self._lane_news_locked(watch)
        if settled or self._stopping.is_set():
            return 200, news.to_json()
        self._lane_watchers.setdefault(watch.group, set()).add(self._park_locked(watch, reply))
        return None

    def _lane_news_locked(self, watch: LaneWatch) -> tuple[RoundNews, bool]:
        """The news of the round the watch follows (the group's latest), and whether it settles the watch."""
        round_id, broken = self._book.watched_round(watch.group)
        news = RoundNews(round_id, broken.reason, tuple(sorted(broken.gone))) if broken else RoundNews(round_id)
        seen = watch.gone_seen if round_id == watch.round_id else 0
        return news, len(news.gone) > seen

    def _end_lane_watch_locked(self, poll: _Poll) -> None:
        assert isinstance(poll.request, LaneWatch), f"not a lane watch: {poll.request!r}"
        watchers = self._lane_watchers.get(poll.group, set())
        watchers.discard(poll)
        if not watchers:
            self._lane_watchers.pop(poll.group, None)
        poll.answer(200, self._lane_news_locked(poll.request)[0].to_json())

    def _commit(self, commit: RoundCommit) -> RoundNews:
        progress = commit.group_progress if commit.progress else None  # none sent: the board keeps the last
        with self._lock:
            reason = self._book.commit(commit.group, commit.round_id, commit.step, self._clock())
            if progress is not None:
                self._board.progress(commit.group, progress)
            if not reason:
                self._steps[commit.group] = commit.step
                self._board.committed(commit.group)
        if reason:
            log.warning("group %s may not commit round %d: %s", commit.group, commit.round_id, reason)
        return RoundNews(commit.round_id, reason)  # only ``broken`` is read

    def _wake_lane_watchers_locked(self, groups: Iterable[str]) -> None:
        """Answer the lane watches of ``groups`` (whose rounds changed) that this change settles."""
        for group in groups:
            for poll in list(self._lane_watchers.get(group, ())):
                if self._lane_news_locked(poll.request)[1]:  # type: ignore[arg-type]
                    self._end_lane_watch_locked(poll)

    def _quorum_locked(self, ask: QuorumAsk, store_host: str, reply: Reply) -> tuple[int, dict] | None:
        """Register the request; it is answered once a decision settles its fate or its wait runs out."""
        group = ask.group
        if self._stopping.is_set():
            return _STOPPING.status, _STOPPING.to_json()
        if self._book.ended is not None:
            return self._end_answer_locked(group, ask.finished)
        now = self._clock()
        self._book.heartbeat(group, now, quorum_id_seen=ask.quorum_id, finished=ask.finished)
        earlier = self._waiters.get(group)
        if earlier is not None:
            superseded = ErrorAnswer(ErrorCode.SUPERSEDED, f"superseded: group {group!r} sent a newer quorum request")
            earlier.answer(superseded.status, superseded.to_json())
        self._waiters[group] = self._park_locked(ask, reply, store_host)
        self._steps[group] = ask.step
        if ask.progress:  # none sent (a client that reports only in heartbeats): the board keeps the last
            self._board.progress(group, ask.group_progress)
        request = QuorumRequest(
            group, ask.step, ask.commit_failed, ask.finished, ask.digest, ask.round_step, ask.lane_failed
        )
        self._book.ask(request, now)
        self._asked = True  # round watchers: a round may have opened
        self._decide_now.set()
        if self._book.everyone_asked():
            self._decide_at_once.set()
        return None

    def _round_watch_locked(self, watch: RoundWatch, reply: Reply) -> tuple[int, dict] | None:
        """Answered once a peer opens a later round (its inner step), or with 0 when the wait runs out."""
        round_step = self._book.open_round(watch.group, (watch.step, watch.round_step))
        if round_step or self._stopping.is_set():
            return 200, {"round_step": round_step}
        self._round_watchers.add(self._park_locked(watch, reply))
        return None

    def _finish_locked(self, poll: _Poll, stopping: bool = False) -> None:
        """Answer a long poll whose wait ran out, or that the stopping lighthouse gives up."""
        request = poll.request
        if isinstance(request, LaneWatch):
            return self._end_lane_watch_locked(poll)
        if isinstance(request, RoundWatch):
            self._round_watchers.discard(poll)
            return poll.answer(200, {"round_step": 0})
        message = self._give_up_locked(poll)
        error = _STOPPING if stopping else ErrorAnswer(ErrorCode.TIMEOUT, message)
        poll.answer(error.status, error.to_json())

    def _give_up_locked(self, waiter: _Poll) -> str:
        """Withdraw a request whose wait ran out; the message says who could have joined it."""
        assert isinstance(waiter.request, QuorumAsk), f"not a quorum request: {waiter.request!r}"
        now = self._clock()
        healthy, asked = sorted(self._book.healthy(now)), sorted(self._book.pending)
        if self._waiters.get(waiter.group) is waiter:
            del self._waiters[waiter.group]
            self._book.withdraw(waiter.group)
        if waiter.request.finished:  # waiting for the job's end, not for a quorum of training groups
            finished = sorted(g for g in self._book.finished if g in healthy)
            first = min((self._book.finished_at.get(g, now) for g in finished), default=now)
            left = max(0.0, self.rules.end_timeout_s - (now - first))
            return (
                f"the job has not ended: groups {finished} finished, {sorted(set(healthy) - set(finished))} "
                f"train on; it ends once every group finished, or in {left:.0f} s "
                f"(cluster.timeouts.end={self.rules.end_timeout_s:g} s after the first finished)"
            )
        return (
            f"no quorum within {min(waiter.request.timeout_s, MAX_POLL_S):g} s: healthy groups {healthy}, "
            f"asked {asked}; a quorum needs cluster.min_groups={self.rules.min_groups} askers and a strict majority "
            f"of the healthy groups, after a join wait of {self._book.join_wait():.2g} s "
            f"(cluster.timeouts.join={self.rules.join_timeout_s:g} s, longer while groups ask far apart)"
        )

    def _end_answer_locked(self, group: str, finished: bool) -> tuple[int, dict]:
        """After the end a finished group learns it; any other is too late to take part."""
        end = self._book.ended
        assert end is not None, "called only once the job has ended"
        if finished:
            self._told_end.add(group)
            return 200, quorum_answer_to_json(end)
        error = ErrorAnswer(
            ErrorCode.JOB_ENDED,
            f"the job ended at round {end.round} (every group finished, or cluster.timeouts.end passed after "
            f"the first did); group {group!r} did not finish and can no longer take part",
        )
        return error.status, error.to_json()

    @property
    def ended(self) -> JobEnd | None:
        with self._lock:
            return self._book.ended

    def awaits_replacement(self, group: str) -> bool:
        """Whether rounds wait for ``group``'s replacement: a recovery notice said so, and its wait has not run out."""
        with self._lock:
            held = self._book.awaited.get(group)
            return held is not None and self._clock() < held[1]

    def wait_replies_sent(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no POST's answer is still being written; True if none is.

        A group is counted as told the job's end when its answer is decided, a moment before
        the answer is on the wire: a lighthouse that left then cut off groups that finished
        together (30 groups in lockstep), which then waited out their timeouts.
        """
        deadline = time.monotonic() + timeout_s
        while self._server is not None and self._server.posts_in_flight() > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def open_polls(self) -> int:
        """Long polls parked with no answer yet: quorum asks, lane and round watches."""
        with self._lock:
            return len(self._waiters) + sum(map(len, self._lane_watchers.values())) + len(self._round_watchers)

    def served_end(self) -> bool:
        """The job ended and every group that had finished by then has been told."""
        with self._lock:
            end = self._book.ended
            return end is not None and set(self._book.finished) <= self._told_end

    # -- decisions -----------------------------------------------------------------------
    def _decide_loop(self) -> None:
        while not self._stopping.is_set():
            self._decide_now.wait(DECIDE_EVERY_S)
            self._decide_now.clear()
            self._decide_at_once.clear()
            began = time.thread_time()  # the pass's own work, not its waits for the lock and the CPU
            with self._lock:
                now = self._clock()
                self._decide_locked(now)
                self._settle_polls_locked(now)
            self._decide_at_once.wait(min(DECIDE_EVERY_S, (time.thread_time() - began) * (1 / DECIDE_SHARE - 1)))

    def _settle_polls_locked(self, now: float) -> None:
        """Answer the round watches a round opened for, and every long poll whose wait ran out."""
        if self._asked:
            self._asked = False
            for poll in list(self._round_watchers):
                watch = poll.request
                assert isinstance(watch, RoundWatch), f"not a round watch: {watch!r}"
                if round_step := self._book.open_round(watch.group, (watch.step, watch.round_step)):
                    self._round_watchers.discard(poll)
                    poll.answer(200, {"round_step": round_step})
        while self._deadlines and self._deadlines[0][0] <= now:
            poll = heapq.heappop(self._deadlines)[2]
            if not poll.done:
                self._finish_locked(poll)
        if len(self._deadlines) > 2 * self._deadlines_kept + 1000:  # answered polls still hold their requests
            self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
            heapq.heapify(self._deadlines)
            self._deadlines_kept = len(self._deadlines)

    def _decide_locked(self, now: float) -> None:
        """Run the pure rules once and answer every request whose fate they settled."""
        told = self._book.break_rounds(now)
        for reason in sorted(set(told.values())):
            log.warning("%s; its other members give it up", reason)
        self._wake_lane_watchers_locked(told)
        quorum = self._book.decide(now)
        self._board.membership(self._book.healthy(now))
        if quorum is not None:
            self._current = (quorum, now)
            shown = quorum.to_json()
            del shown["endpoints"]  # the groups', for their probes: 30 KB at 1,000 groups, of no use in a log
            formed = {**shown, "formed_at": time.time(), "grants_sent_at": None}
            self._history.append(formed)
            self._board.quorum_formed(quorum)
            log.info("%s", formed_line(quorum))
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
                    assert isinstance(waiter.request, QuorumAsk), f"not a quorum request: {waiter.request!r}"
                    grant = self._grant_bytes(quorum, waiter.store_host, waiter.request.known_quorum)
                    waiter.answer(200, grant, functools.partial(_stamp_sent, formed))
        for group, reason in self._book.turned_away.items():
            waiter = self._waiters.pop(group, None)
            if waiter is not None:
                error = ErrorAnswer(ErrorCode.WITHDRAWN, f"request of group {group!r} withdrawn: {reason}")
                waiter.answer(error.status, error.to_json())
        self._book.turned_away.clear()
        if self._book.ended is None and (end := self._book.end_of_job(now)) is not None:
            log.info("the job ended at round %d, held by %s", end.round, ", ".join(end.holders))
            self._board.event("end", "", f"round {end.round}, held by {', '.join(end.holders)}")
        if self._book.ended is not None:
            for group, waiter in list(self._waiters.items()):
                waiter.answer(*self._end_answer_locked(group, group in self._book.finished))
                del self._waiters[group]

    # -- status --------------------------------------------------------------------------
    def alive(self) -> dict[str, int]:
        """What /alive serves: the pid, so a launcher tells its own lighthouse from another process
        on the port, asked twice a second by its watch. It takes the lock, as every request does: a
        lighthouse stuck holding it is silent here too. /status, a snapshot of every group, had
        served the watch: about 1 MB and 0.4 s to build at 1,000 groups."""
        with self._lock:
            return {"pid": os.getpid()}

    def status(self) -> dict[str, Any]:
        """What /status serves: a read-only snapshot, holding no secrets (the pid lets a launcher
        tell its own lighthouse from another process on the port)."""
        with self._lock:
            snap = status_page.snapshot(
                self.job_id,
                self._identity.signature,
                self._book,
                self._steps,
                self._current,
                self._history,
                self._clock(),
                self._board,
            )
        return {"pid": os.getpid()} | status_page.build_status(snap)


def _stamp_sent(formed: dict[str, Any]) -> None:
    """A grant of the quorum ``formed`` (its history entry) is all handed to its socket; the last
    one's time stays: with ``formed_at`` it tells a round late in the lighthouse's writes from one
    late on the way to the groups. Set on the HTTP loop without the lock: the key
    exists, so /status's snapshot, read meanwhile, sees the old time or the new."""
    formed["grants_sent_at"] = time.time()


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


def formed_line(quorum: Quorum) -> str:
    """``quorum 13 for round 12: group0, group1 (lane 3; group1 heals from group0)``: a quorum as its
    log line (its number among the job's quorums, the round its participants commit next), the
    participants cut short past ``status_page.SHOWN_NAMES`` (1,000 names were 12 KB a round)."""
    notes = [f"lane {quorum.quorum_id}"]
    notes += [f"{group} heals from {source}" for group, source in sorted(quorum.heal_from.items())[:3]]
    if len(quorum.heal_from) > 3:
        notes.append(f"{len(quorum.heal_from) - 3} more heal")
    if quorum.closing:
        notes.append("closing: the finished groups hand on the final state")
    if quorum.round_floor:
        notes.append(f"going on from round {quorum.round_floor - 1}")
    names = status_page.shown_names(quorum.participants)
    return f"quorum {quorum.round_id} for round {quorum.max_step + 1}: {names} ({'; '.join(notes)})"


def serve_forever(
    cfg: LighthouseConfig,
    rules: QuorumRules,
    job_id: str,
    model_signature: str | None = None,
    job_config: dict[str, Any] | None = None,
    saved_page: Path | None = None,
) -> None:
    """Run a lighthouse until SIGINT or SIGTERM, or until its job has ended (call from the main thread).

    After the end it stays until every finished group has been told (at most
    ``rules.end_timeout_s``), then returns: exiting 0 means the job is over, so an
    orchestrator restarts the lighthouse only when it exits any other way. Stopped by a
    signal before the end, it exits 1 (``SystemExit`` with the reason): it is not done.
    Either way it first writes its status page as it stands to ``saved_page``, if given.
    """
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Lighthouse(cfg, rules, job_id, model_signature, job_config=job_config) as lighthouse:
            # The ~170,000 objects of the modules (torch's mostly) live as long as the process: out of
            # every full collection, which had paused the lighthouse up to 240 ms at 1,000 groups.
            gc.freeze()
            print(f"lighthouse for job {job_id!r} at {lighthouse.url}; status page {lighthouse.url}/", flush=True)
            ended = _serve_until_the_end(lighthouse, rules, done)
            if saved_page is not None:
                save_page(lighthouse, saved_page)
            if ended:
                print(f"job {job_id!r} ended at round {lighthouse.ended.round}; lighthouse exiting", flush=True)
                return
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    sys.exit(f"lighthouse of job {job_id!r} stopped by a signal before the job ended")


def _serve_until_the_end(lighthouse: Lighthouse, rules: QuorumRules, done: threading.Event) -> bool:
    """True once the job has ended and every finished group was told (or ``rules.end_timeout_s``
    passed); False when ``done`` is set first (a signal)."""
    ended_at = None
    while not done.wait(0.1):
        if ended_at is None and lighthouse.ended is not None:
            ended_at = time.monotonic()
        if ended_at is not None and (lighthouse.served_end() or time.monotonic() - ended_at > rules.end_timeout_s):
            lighthouse.wait_replies_sent(timeout_s=5.0)
            return True
    return False


def save_page(lighthouse: Lighthouse, path: Path) -> None:
    """Write the status page as it stands to ``path``, a file that opens without the lighthouse
    (``status_page.render_saved_html``); one that cannot be written is logged, not raised: the
    picture is no reason to fail a lighthouse whose job ended."""
    try:
        write_text_atomically(path, status_page.render_saved_html(lighthouse.status()))
    except OSError as error:
        log.warning("status page not saved: %s", error)
        return
    log.info("status page saved to %s", path)
