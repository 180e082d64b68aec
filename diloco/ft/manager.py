"""One worker's side of the fault-tolerant outer layer: quorum, lanes, commit.

The group's leader (local rank 0) talks to the lighthouse and shares each answer with its
group over the inner process group, so every worker of a group acts on the same quorum. A
round is committed only if every rank of the group succeeded; the committed-round counter
is what the lighthouse compares to decide who is behind and must heal. A round the
lighthouse saw lose a member is given up by every worker in it at once (``LaneWatcher``), and
the lighthouse allows a group's commit only of a round it has not seen break, so a member
that resumes after the others gave the round up does not commit it alone.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from diloco.ft.client import LighthouseClient
from diloco.ft.lane_watch import LaneWatcher
from diloco.ft.lanes import CancelScope, LaneCancel, LaneError, Lanes
from diloco.ft.protocol import (
    ErrorCode,
    GroupProgress,
    LighthouseRefused,
    LighthouseUnavailable,
    QuorumSuperseded,
    QuorumTimeout,
)
from diloco.ft.quorum import JobEnd, Quorum
from diloco.ft.reach import ReachProbes
from diloco.ft.round_watch import RoundWatcher

log = logging.getLogger(__name__)

MAX_BROADCAST_BYTES = 1 << 20
MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
FIRST_CONTACT_RETRY_S = 0.5


class MembershipError(RuntimeError):
    """This group cannot take part in the job: refused by the lighthouse, or it cannot reach it
    at start. Not a fault to retry: the message says what to fix."""


class GroupRefused(MembershipError):
    """The lighthouse refused this group (its token, job, group count or configuration): the same
    group started again would be refused alike, so an orchestrator must not restart it."""


class JobEndedError(MembershipError):
    """The job ended before this (unfinished) group asked: too late to take part, and no crash
    either; a supervisor restarts nothing for it."""


@dataclass(frozen=True)
class Round:
    """What this worker does in one outer round, derived from the quorum."""

    quorum: Quorum
    group: str
    lane: dist.ProcessGroup
    lane_rank: int
    cancel: LaneCancel  # when waits on ``lane`` must end: give each wait its ``stop_when``

    def stop_when(self, peer_rank: int | None = None) -> CancelScope:
        """When a wait on the lane ends early: for a collective (``peer_rank`` None) or a transfer with that rank."""
        return CancelScope(self.cancel, None if peer_rank is None else self.quorum.participants[peer_rank])

    @property
    def heal_source(self) -> int | None:
        """Lane rank of the peer this group receives the live state from, if it is behind."""
        source = self.quorum.heal_from.get(self.group)
        return None if source is None else self.quorum.rank_of(source)

    @property
    def heal_targets(self) -> list[int]:
        """Lane ranks of the groups this group sends its state to."""
        return [self.quorum.rank_of(g) for g, src in sorted(self.quorum.heal_from.items()) if src == self.group]

    @property
    def size(self) -> int:
        return len(self.quorum.participants)


class Manager:
    """Quorum rounds and commits for one worker of replica group ``group``."""

    def __init__(
        self,
        *,
        group: str,
        inner_pg: dist.ProcessGroup | None,
        client: LighthouseClient | None,
        lanes: Lanes,
        quorum_timeout_s: float,
        heartbeat_interval_s: float,
        watch_rounds: bool = False,
        lane_watch: LaneWatcher | None = None,
        probes: ReachProbes | None = None,
    ) -> None:
        """``watch_rounds``: time-bounded windows; the leader learns the rounds its peers open
        (``open_round_step``). ``lane_watch`` (every rank): rounds that lose a member are given up at once.
        ``probes`` (the leader): its probes of peers, reported in its asks and heartbeats (``diloco.ft.reach``)."""
        self.group = group
        self.inner_pg = inner_pg
        self.client = client  # only the leader has one
        self.lanes = lanes
        self.quorum_timeout_s = quorum_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._committed = 0
        self.last_commit_failed = False
        self._finished = False  # trained to the end: only serves (or takes) the final state now
        self._no_quorum_since: float | None = None
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._without_quorum = False
        self.refused: str | None = None
        self._progress = GroupProgress()  # what its heartbeats, asks and commits show on the status page
        self._stop = threading.Event()
        self._heartbeats: threading.Thread | None = None
        self._round_step = 0  # the inner step of the last round this group asked for
        self._watcher = RoundWatcher(client, quorum_timeout_s) if watch_rounds and client is not None else None
        self._lane_watch = lane_watch
        self._probes = probes
        self._last_quorum: Quorum | None = None  # the leader's last grant: whom to probe once its lane failed
        self._probed_failure: LaneCancel | None = None  # the failed lane whose peers were probed
        self._round_bytes = 0

    def start(self) -> None:
        """The leader reaches the lighthouse, then heartbeats in the background, so a long inner
        phase is not mistaken for death; every rank starts its lane watch.

        A lighthouse that cannot be reached within the connect timeout at start is a
        configuration error (a wrong host or port), not an outage to train through: training
        alone would end with a model no round produced.
        """
        if self.client is not None:
            self._first_contact()
            self._heartbeats = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
            self._heartbeats.start()
            if self._watcher is not None:
                self._watcher.start()
        if self._lane_watch is not None:
            self._lane_watch.start()

    def stop(self) -> None:
        self._stop.set()
        for watcher in (self._watcher, self._lane_watch):
            if watcher is not None:
                watcher.stop()
        if self._heartbeats is not None:
            self._heartbeats.join(timeout=self.heartbeat_interval_s + 5)
        if self._probes is not None:
            self._probes.close()
        self.lanes.drop()

    @property
    def committed(self) -> int:
        """Rounds this group has committed (or adopted from a peer): what the lighthouse compares."""
        return self._committed

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def start_round_timeout_s(self) -> float:
        """The longest ``start_round`` waits: the quorum, then the lane's rendezvous."""
        return self.quorum_timeout_s + self.lanes.connect_timeout_s

    def finish(self) -> None:
        """Trained to the end: from now on the group only serves (or takes) the final state, and says so."""
        self._finished = True

    def abandon_round(self) -> None:
        """Give up the current round everywhere: the lane is aborted, so its pending and later
        collectives fail at once on every member; the next quorum builds a fresh lane."""
        self.lanes.drop()

    def note_round_bytes(self, nbytes: int) -> None:
        """The bytes this worker's lane carried in its last round: reported (the leader's) with its
        timed links, so the lighthouse weighs a slow link by what it holds up (``Reachability.slow_links``)."""
        self._round_bytes = nbytes

    def note_progress(self, **changes: Any) -> None:
        """Update what the next heartbeat, ask or commit reports for the status page (``GroupProgress`` fields)."""
        self._progress = dataclasses.replace(self._progress, **changes)

    def adopt(self, committed: int) -> None:
        """A peer's state was applied: this group now stands at the peer's committed round."""
        self._committed = committed
        self._moved()

    def open_round_step(self) -> int:
        """The inner step of the round the group's peers opened past its own last one, as the
        leader knows it (0: none), the same on every rank (a collective: call it on all of them)."""
        known = self._watcher.open_step if self._watcher is not None else 0
        return self.from_leader([known])[0]

    def from_leader(self, values: list[int]) -> list[int]:
        """The leader's ``values`` on every rank of the group (a collective: call it on all of them)."""
        if self.inner_pg is None:
            return values
        shared = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(shared, src=0, group=self.inner_pg)
        return [int(v) for v in shared]

    def start_round(self, round_step: int) -> Round | None:
        """Ask for a quorum (leader), share it with the group, and make sure the lane matches it.

        ``round_step`` is the inner step the round is launched at: a quorum reduces only
        groups at the same one, and heals the others to it.

        Returns ``None`` when there is no quorum this time (lighthouse down, timeout, lane
        could not form, or was given up as a member hung in its rendezvous): the group then
        keeps training and tries again at its next sync.
        Raises ``MembershipError`` when the lighthouse refused the group (wrong token, job,
        model or configuration; the job already ended).
        """
        self._round_step = round_step
        self._moved()
        return self._round(self._exchange(round_step))

    def closing_round(self, step: int, digest: str) -> Round | JobEnd | None:
        """A finished group's round: serve the final state to groups behind, take it if behind, or learn the end.

        ``digest`` is this group's global-state digest, which the lighthouse passes on as the
        job's final one if this group saves the model.
        """
        answer = self._exchange(step, digest)
        return JobEnd.from_json(answer["end"]) if "end" in answer else self._round(answer, "waiting for the end")

    def seconds_without_quorum(self) -> float:
        """How long the group has gone without a quorum (0 while rounds form)."""
        return 0.0 if self._no_quorum_since is None else time.monotonic() - self._no_quorum_since

    def _exchange(self, round_step: int, digest: str = "") -> dict[str, Any]:
        """The leader asks the lighthouse; every rank gets its answer."""
        answer = self._broadcast(self._ask(round_step, digest) if self.client is not None else None)
        if "refused" in answer:
            too_late = answer.get("code") == ErrorCode.JOB_ENDED.value
            raise (JobEndedError if too_late else GroupRefused)(
                f"the lighthouse refused group {self.group}: {answer['refused']}"
            )
        return answer

    def _round(self, answer: dict[str, Any], meanwhile: str = "training on") -> Round | None:
        if "quorum" not in answer:
            # Once per outage, not once per sync: a dead lighthouse must not flood the log.
            (log.debug if self._without_quorum else log.warning)(
                "group %s: no quorum (%s); %s", self.group, answer.get("error"), meanwhile
            )
            self._without_quorum = True
            if self._no_quorum_since is None:
                self._no_quorum_since = time.monotonic()
            return None
        if self._without_quorum:
            log.warning("group %s: quorum again after %.0fs without one", self.group, self.seconds_without_quorum())
            self._without_quorum = False
        self._no_quorum_since = None
        quorum = Quorum.from_json(answer["quorum"])
        lane_rank = quorum.rank_of(self.group)
        # Followed before the lane forms: a member that hangs in the rendezvous ends it too.
        watch = self._lane_watch
        follow = None if watch is None else functools.partial(watch.follow, quorum.round_id)
        try:
            store = tuple(answer["store"])
            lane = self.lanes.ensure(quorum.quorum_id, lane_rank, len(quorum.participants), store, follow)
            ok = True
        except LaneError as error:
            log.warning("group %s: %s", self.group, error)
            ok = False
        if not self.all_ranks(ok):  # every rank of the group must have its lane, or none uses it
            self.lanes.drop()
            self.last_commit_failed = True
            return None
        if self._probes is not None:
            self._probes.round_opened({g: e for g, e in quorum.endpoints.items() if g != self.group})
        return Round(quorum=quorum, group=self.group, lane=lane, lane_rank=lane_rank, cancel=self.lanes.cancel)

    def commit(self, round_: Round, local_ok: bool) -> bool:
        """Commit the round iff every rank of this group succeeded and the lighthouse allows it
        (it has not seen the round lose a member); a failure drops the lane."""
        committed = max(self._committed, round_.quorum.round_floor) + 1
        ok = self.all_ranks(local_ok) and self._allowed(round_, committed)
        self._settled(ok)
        if ok:
            self._committed = committed
            self._moved()
        return ok

    def _allowed(self, round_: Round, committed: int) -> bool:
        """The leader's commit request, its answer shared with the group (a collective).

        A lighthouse that cannot be reached allows nothing: it may have told the round's other
        members that it broke, and a group that does not commit merely heals later.
        """
        why = ""
        if self.client is not None:
            try:
                why = self.client.commit(round_.quorum.round_id, committed, self._progress)
            except (LighthouseUnavailable, LighthouseRefused) as error:
                why = f"the lighthouse did not confirm the commit: {error}"
            if why:
                log.warning("group %s: round %d not committed: %s", self.group, round_.quorum.round_id, why)
        return self.from_leader([0 if why else 1])[0] == 1

    def settle(self, local_ok: bool) -> bool:
        """End a round that changes no global state (a group's join): True iff every rank of
        this group succeeded; a failure drops the lane. The committed count stays."""
        ok = self.all_ranks(local_ok)
        self._settled(ok)
        return ok

    def _settled(self, ok: bool) -> None:
        if self._probes is not None:
            self._probes.round_closed()
        if not ok:
            self.lanes.drop()
        self.last_commit_failed = not ok

    def sum_over_ranks(self, value: float) -> float:
        """``value`` summed over every rank of the group (a collective: call it on all of them)."""
        if self.inner_pg is None:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self.inner_pg)
        return float(total.item())

    def all_ranks(self, ok: bool) -> bool:
        """True only if ``ok`` holds on every rank of the group (a MIN all-reduce)."""
        if self.inner_pg is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.inner_pg)
        return bool(flag.item())

    def combine_digests(self, own: bytes) -> str:
        """One hex digest for the group: sha256 over every rank's digest in rank order."""
        mine = torch.frombuffer(bytearray(own), dtype=torch.uint8)
        if self.inner_pg is None:
            parts = [mine]
        else:
            parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.inner_pg))]
            dist.all_gather(parts, mine, group=self.inner_pg)
        return hashlib.sha256(b"".join(bytes(p.tolist()) for p in parts)).hexdigest()

    def _moved(self) -> None:
        if self._watcher is not None:
            self._watcher.moved(self._committed, self._round_step)

    def _first_contact(self) -> None:
        assert self.client is not None
        deadline = time.monotonic() + self.client.connect_timeout_s
        while True:
            try:
                self.client.heartbeat(self.committed, 0, self.finished, reach=self._reach_report())
                return
            except LighthouseRefused as error:
                raise GroupRefused(f"the lighthouse refused group {self.group}: {error}") from None
            except LighthouseUnavailable as error:
                if time.monotonic() >= deadline:
                    raise MembershipError(
                        f"group {self.group} cannot reach the lighthouse at {self.client.url} within "
                        f"cluster.timeouts.connect={self.client.connect_timeout_s:g}s ({error}); check "
                        "cluster.lighthouse.host and cluster.lighthouse.port, and that the lighthouse runs"
                    ) from None
                time.sleep(FIRST_CONTACT_RETRY_S)

    def _ask(self, round_step: int, digest: str) -> dict[str, Any]:
        """The leader's ask. Once its lane failed it first probes the last quorum's members, and
        the ask reports whom it did not reach. A grant whose new lane would need a peer its probe
        cannot reach is given up at once: a heartbeat reports the peer, the lighthouse ends the
        round for every member, and all ask again at their next sync, where the lighthouse forms
        a quorum of groups that reach each other instead of a lane that times out (``diloco.ft.reach``)."""
        cancel = self.lanes.cancel
        if cancel.failed and cancel is not self._probed_failure and self._last_quorum is not None:
            self._probed_failure = cancel  # once per failed lane: suspects are probed again in the background
            self._probe(self._last_quorum)
        answer = self._ask_once(
            round_step, digest, cancel.failed
        )  # the leader's lane: every lane crosses the same links
        quorum = Quorum.from_json(answer["quorum"]) if "quorum" in answer else None
        if quorum is None or quorum.quorum_id == self.lanes.quorum_id:
            return answer
        unreached = self._probe(quorum)
        if not unreached:
            return answer
        self._report_now()
        return {"error": f"cannot reach group(s) {', '.join(unreached)} of quorum {quorum.quorum_id}: said so"}

    def _report_now(self) -> None:
        """A heartbeat now, carrying the probes' results (``_ask``); one that does not arrive goes with the next."""
        assert self.client is not None
        reach = self._reach_report()
        try:
            self.client.heartbeat(self.committed, self.lanes.quorum_id or 0, self.finished, self._progress, reach)
        except (LighthouseUnavailable, LighthouseRefused) as error:
            if self._probes is not None and reach is not None:
                self._probes.keep_unsent(reach)
            log.warning("group %s: could not report the peers it cannot reach: %s", self.group, error)

    def _probe(self, quorum: Quorum) -> list[str]:
        """Probe the quorum's other members (the leader, with probes); those not reached. Their
        links are the ones it times from now on."""
        self._last_quorum = quorum
        if self._probes is None:
            return []
        peers = {g: e for g, e in quorum.endpoints.items() if g != self.group}
        self._probes.time_links(peers)
        return self._probes.probe_now(peers)

    def _reach_report(self) -> dict[str, Any] | None:
        return None if self._probes is None else self._probes.report() | {"round_bytes": self._round_bytes}

    def _ask_once(self, round_step: int, digest: str, lane_failed: bool) -> dict[str, Any]:
        assert self.client is not None
        if self.refused:
            return {"refused": self.refused}
        if time.monotonic() < self._retry_at:
            return {"error": f"lighthouse unreachable; next try in {self._retry_at - time.monotonic():.1f}s"}
        reach = self._reach_report()
        try:
            answer = self.client.quorum(
                self.committed,
                self.last_commit_failed,
                self.quorum_timeout_s,
                round_step=round_step,
                finished=self.finished,
                digest=digest,
                lane_failed=lane_failed,
                progress=self._progress,
                reach=reach,
            )
        except LighthouseRefused as error:
            return {"refused": str(error), "code": error.code.value}
        except (QuorumTimeout, QuorumSuperseded) as error:  # superseded: our own abandoned request; ask again
            return {"error": str(error)}
        except LighthouseUnavailable as error:
            if self._probes is not None and reach is not None:
                self._probes.keep_unsent(reach)
            # Exponential backoff, so a dead lighthouse costs the groups nothing but skipped syncs.
            self._backoff_s = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff_s))
            self._retry_at = time.monotonic() + self._backoff_s
            return {"error": str(error)}
        self._backoff_s = 0.0
        if isinstance(answer, JobEnd):
            return {"end": answer.to_json()}
        quorum, store = answer
        return {"quorum": quorum.to_json(), "store": list(store)}

    def _broadcast(self, answer: dict[str, Any] | None) -> dict[str, Any]:
        """The leader's answer on every rank, as JSON bytes (never pickled)."""
        if self.inner_pg is None:
            assert answer is not None
            return answer
        leader = answer is not None
        payload = json.dumps(answer).encode() if leader else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.inner_pg)
        n = int(size.item())
        if not 0 < n <= MAX_BROADCAST_BYTES:
            raise RuntimeError(f"group {self.group}: leader sent a quorum message of {n} bytes")
        buffer = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8) if leader else torch.empty(n, dtype=torch.uint8)
        )
        dist.broadcast(buffer, src=0, group=self.inner_pg)
        return answer if leader else json.loads(bytes(buffer.tolist()).decode())

    def _heartbeat_loop(self) -> None:
        """A beat every ``heartbeat_interval_s`` after the group's last sign of life: an ask or a
        commit that went out meanwhile was one (``LighthouseClient.beat_due_in``), unless a cut may
        stand (``ReachProbes.suspecting``): the beat's answer then says whom to probe again."""
        assert self.client is not None
        wait = self.heartbeat_interval_s
        while not self._stop.wait(wait):
            wait = self.client.beat_due_in(self.heartbeat_interval_s)
            if wait > 0 and not (self._probes is not None and self._probes.suspecting):
                continue
            wait = self.heartbeat_interval_s
            reach = self._reach_report()
            try:
                probe = self.client.heartbeat(
                    self.committed, self.lanes.quorum_id or 0, self.finished, self._progress, reach
                )
                self._retry_at = 0.0  # the lighthouse answers again: stop backing off
                if self._probes is not None:
                    self._probes.suspect(probe)  # peers it stands cut from: is the link back?
            except LighthouseRefused as error:
                self.refused = str(error)
                log.error("group %s: heartbeat refused: %s", self.group, error)
                return
            except LighthouseUnavailable as error:
                if self._probes is not None and reach is not None:
                    self._probes.keep_unsent(reach)
                log.debug("group %s: heartbeat failed (%s); retrying", self.group, error)
