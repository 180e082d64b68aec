"""What every synchronizer shares: rounds through the manager, healing, commit records, digests.

``OuterSync`` (DiLoCo, Streaming DiLoCo) and ``GradientSync`` (the data-parallel baseline)
differ only in what they all-reduce and when; the trainer talks to either through the
hooks of ``SyncHooks`` (diloco/train/sync_hooks.py), whose no-op defaults they override.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from diloco.ft.fault_requests import FaultHook
from diloco.ft.manager import Manager, MembershipError, Round
from diloco.ft.quorum import JobEnd
from diloco.ft.state import HealState, Position
from diloco.outer.bandwidth import TokenBucket
from diloco.outer.digest import state_digest
from diloco.outer.phases import PhaseClock
from diloco.train.sync_hooks import SyncHooks

log = logging.getLogger(__name__)

# A state (θ_g and outer state) at least this large is hashed beside the next inner steps rather
# than on the commit's critical path (``Synchronizer._record``): 0.7 s at 150M parameters on one core.
DIGEST_BEHIND_BYTES = 64 << 20
NO_QUORUM_PAUSE_S = 0.2  # between a finished group's asks while the lighthouse is unreachable
# What a checkpoint keeps of a synchronizer besides its tensors, so a resumed job's report goes on counting.
_COUNTERS = ("attempted", "committed_here", "bytes_sent", "tokens", "tokens_committed", "recoveries")
# The trainer's metrics the status page shows, by the ``GroupProgress`` field each is reported in.
_PROGRESS_FIELDS = {"train/loss": "train_loss", "train/tokens_per_s": "tokens_per_s", "eval/loss": "eval_loss"}


def _finite_or_none(value: float) -> float | None:
    """``value``, or None where it is not finite: a diverged group reports no loss rather than NaN,
    which the lighthouse would refuse."""
    return value if math.isfinite(value) else None


def all_finite(update: torch.Tensor) -> bool:
    """Whether every entry of ``update`` is finite, read off its sum: a NaN or an infinity anywhere
    makes the sum NaN or infinite, and no further addition makes it finite again. Only a sum that
    overflowed from finite entries is checked entry by entry (the full check's boolean temporary
    of the model's size cost 0.7 s at 150M parameters, the sum 0.02 s)."""
    return bool(torch.isfinite(update.sum())) or bool(torch.isfinite(update).all())


class Synchronizer(SyncHooks):
    """Bookkeeping and healing shared by the synchronizers; subclasses add the all-reduce.

    ``commit_log``: the file each round's record is appended to as a JSON line (the group's
    leader's; None: no records). ``faults`` is composed in only when the job injects faults into workers (see ``FaultHook``);
    without it a round costs no fault bookkeeping at all. ``bucket`` limits the bandwidth of
    the outer all-reduces (``cluster.lane_bandwidth_mbps``).

    ``hashes_behind``: whether the digest of a large state may be hashed beside the inner steps
    that follow its commit (``_record``); only where the state hashed is a copy the inner steps
    do not touch (θ_g), not the live model.
    """

    hashes_behind = False

    def __init__(
        self,
        *,
        manager: Manager,
        heal_state: HealState,
        collective_timeout_s: float,
        end_wait_s: float,
        commit_log: Path | None,
        faults: FaultHook | None = None,
        bucket: TokenBucket | None = None,
    ) -> None:
        self.manager = manager
        self.bucket = bucket  # cluster.lane_bandwidth_mbps: paces this worker's outer traffic
        self.faults = faults
        self.heal_state = heal_state
        self.collective_timeout_s = collective_timeout_s
        self.end_wait_s = end_wait_s
        self.commit_log = commit_log
        if commit_log is not None:
            commit_log.parent.mkdir(parents=True, exist_ok=True)
        self.end: JobEnd | None = None  # set once the lighthouse declares the job's end
        self.attempted = 0
        self.committed_here = 0
        self.bytes_sent = 0
        self.tokens = 0
        self.tokens_committed = 0.0  # tokens whose inner steps reached a committed global model
        self.recoveries = 0
        self.nonfinite_updates = 0  # left out by the guard: when every one was, the reason a group never committed
        self.diverged_updates = 0  # non-finite in a row (planned NaNs aside); > 0 in every group at the end: diverged
        self.round_asked_at = 0.0  # wall time this group last started a round (asked for a quorum)
        self._recoveries_recorded = 0
        self._fragment_digests: dict[int, bytes] = {}
        self._held: tuple[dict[str, Any], Future] | None = None  # a record waiting for its digest (``_record``)
        self._hasher: ThreadPoolExecutor | None = None
        self._state_bytes: int | None = None

    def start(self) -> None:
        """Join the job: the leader reaches the lighthouse and heartbeats from now on."""
        self.manager.start()

    def close(self) -> None:
        """Leave the job: stop heartbeating and abort the lane (also after a failure)."""
        self.manager.stop()

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """The trainer's latest numbers, for the lighthouse's status page (sent with every heartbeat,
        ask and commit): a logged step's train loss and rate, an evaluation's loss (``eval/loss``).
        Only the figures ``metrics`` holds change: an evaluation between logged steps keeps the
        last train loss, and a logged step the last eval loss."""
        changes: dict[str, Any] = {
            field: _finite_or_none(metrics[key]) for key, field in _PROGRESS_FIELDS.items() if key in metrics
        }
        if "eval_loss" in changes:  # the step an eval point is drawn at; none without a loss to draw
            changes["eval_step"] = None if changes["eval_loss"] is None else step
        self.manager.note_progress(inner_step=step, **changes)

    def progress_state(self) -> dict[str, Any]:
        """The committed round and the counters, JSON-friendly, for a checkpoint."""
        return {"committed": self.manager.committed} | {name: getattr(self, name) for name in _COUNTERS}

    def load_progress_state(self, state: dict[str, Any]) -> None:
        self.manager.adopt(int(state["committed"]))
        for name in _COUNTERS:
            setattr(self, name, type(getattr(self, name))(state[name]))
        self._recoveries_recorded = self.recoveries
        self._state_changed()

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this synchronizer's tensors: the heal state, and any per-group state."""
        return self.heal_state.tensors()

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore ``checkpoint_tensors`` (named as it names them) into the live state."""
        self.heal_state.load_tensors(tensors)

    def finish(self, step: int) -> JobEnd:
        """After the last inner step ``step``: stay in the job until it ends (docs/design.md, invariant 7).

        Finished is not lost: the group stays a quorum member and heal source, handing its
        final state to groups behind it (a straggler, a restarted group) and taking it if it
        is behind itself, in closing rounds that commit nothing, until the lighthouse
        declares the end. Raises ``MembershipError`` when the end is not confirmed within
        ``end_wait_s`` (the lighthouse gone for good): this group cannot know its state is the job's.
        """
        self.manager.finish()
        self._settle_digest()
        deadline = time.monotonic() + self.end_wait_s
        while True:
            self.round_asked_at = time.time()
            answer = self.manager.closing_round(step, self.group_digest())
            if isinstance(answer, JobEnd):
                self.end = answer
                return answer
            if answer is not None:
                started = time.perf_counter()
                self._heal_and_serve(answer, step, step)
                self._record(answer, False, step, 1000 * (time.perf_counter() - started))
            elif not self.manager.all_ranks(time.monotonic() < deadline):  # every rank gives up together
                raise MembershipError(
                    f"group {self.manager.group} finished training but the lighthouse did not confirm the job's end "
                    f"within {self.end_wait_s:g}s (cluster.timeouts.end + quorum): its state may not be the job's"
                )
            else:
                time.sleep(NO_QUORUM_PAUSE_S)

    def _after_heal(self) -> None:
        """Called once a peer's state has been applied."""

    def _round_starts(self) -> None:
        """Note when the round starts; pick up the faults requested for this group since the last
        round (with a fault hook only)."""
        self._settle_digest()
        self.round_asked_at = time.time()
        if self.faults is not None:
            self.faults.poll()

    def _injects(self, fault: str) -> bool:
        """Whether this round injects ``fault`` (see ``FaultHook``)."""
        return self.faults is not None and self.faults.take(fault)

    def _all_finite(self, update: torch.Tensor) -> bool:
        """Non-finite guard: true only if this update is finite on every rank of the group.

        A group whose update holds NaN or Inf contributes nothing (the others' average is
        untouched), does not commit, and heals from a peer at the next round.
        """
        injected = self._injects("nan")
        if injected:
            update[: min(1, update.numel())] = float("nan")
        finite = self.manager.all_ranks(all_finite(update))
        if not finite:
            self.nonfinite_updates += 1
            log.warning("group %s: non-finite update left out of this round", self.manager.group)
        if finite or not injected:  # a planned NaN says nothing about whether training diverged
            self.diverged_updates = 0 if finite else self.diverged_updates + 1
        return finite

    def _heal_and_serve(self, round_: Round, step: int, round_step: int) -> tuple[bool, Position | None]:
        """Serve groups healing from us; receive a peer's state if we are behind.

        ``step`` is our inner step now, ``round_step`` the one the round was launched at.
        Returns (ok, where the sender stood if we healed: jump to its inner step). The
        received state is staged and applied only if every rank of the group got its part,
        so a failed transfer leaves the live state untouched; the group heals again next
        quorum. A failed transfer may leave messages queued on the lane, so the lane is
        dropped and this round is given up (the next quorum gets a new id and fresh lanes).
        """
        self._settle_digest()  # a received state replaces the θ_g being hashed
        position = Position(committed=self.manager.committed, inner_step=step, round_step=round_step)
        sent = all(
            self.heal_state.send(round_.lane, t, position, self.collective_timeout_s, round_.stop_when(t))
            for t in round_.heal_targets
        )
        source = round_.heal_source
        staged = None
        if source is not None:
            staged = self.heal_state.receive(round_.lane, source, self.collective_timeout_s, round_.stop_when(source))
        transfers_ok = self.manager.all_ranks(sent and (source is None or staged is not None))
        if not transfers_ok:
            self.manager.abandon_round()
            return False, None
        if staged is None:
            return True, None
        healed = self.heal_state.apply(staged)
        self._state_changed()
        self.manager.adopt(healed.committed)
        self._after_heal()
        self.recoveries += 1
        # The step it jumps to, on the page at once: a group that heals straight to the end logs no
        # step of its own. The train loss it reported was of the state it just replaced.
        self.manager.note_progress(inner_step=healed.inner_step, train_loss=None)
        log.info("group %s healed: round %d, inner step %d", self.manager.group, healed.committed, healed.inner_step)
        return True, healed

    def _record(
        self,
        round_: Round,
        committed: bool,
        step: int,
        sync_ms: float,
        tokens: float = 0.0,
        join: bool = False,
        clock: PhaseClock | None = None,
    ) -> dict[str, float]:
        """Append the round's record (with the group's digest when committed or healed) to the
        commit log, and return its metrics.

        ``tokens``: the inner-step tokens this round brought into the global model. A closing
        round (finished groups handing over the final state) and a group's join round
        (``join``: it takes a peer's state or starts from the shared initial one) commit nothing.
        ``sync_ms`` is the time the training thread spent on the round before its digest, which
        is hashed here and added; ``clock``: the round's phases (``outer.phases``), the digest's too.

        A state of ``DIGEST_BEHIND_BYTES`` or more (with ``hashes_behind``) is hashed on a thread
        of its own beside the next inner steps instead: the record is held and appended once its
        digest is known, when the next round starts (``_settle_digest``), and the digest's time is
        in the record, not in ``sync_ms`` nor in this round's metrics.
        """
        self.committed_here += int(committed)
        self.tokens_committed += tokens
        healed = self.recoveries > self._recoveries_recorded
        self._recoveries_recorded = self.recoveries
        clock = clock or PhaseClock()
        digest, hashing = None, None
        if (committed or healed) and self._digest_behind():
            hashing = self._hash_behind()
        elif committed or healed:
            with clock.timed("digest"):
                digest = self.group_digest()
            self.manager.note_progress(digest=digest)
            sync_ms += clock.ms["digest"]
        record = {
            "round": self.manager.committed,
            "committed": committed,
            "healed": healed,
            "closing": round_.quorum.closing,
            "join": join,
            "quorum_id": round_.quorum.quorum_id,
            "round_floor": round_.quorum.round_floor,  # > 0: the job's newest state was lost before this quorum
            "participants": list(round_.quorum.participants),
            "inner_step": step,
            "time": time.time(),
            "asked_at": self.round_asked_at,
            "sync_ms": sync_ms,
            "tokens": tokens,
            "recoveries": self.recoveries,
            "pid": os.getpid(),
            "digest": digest,
            "phases_ms": clock.ms,
        } | self._record_fields()
        if hashing is None:
            self._append(record)
        else:
            self._held = record, hashing
        return {
            "outer/committed": float(committed),
            "outer/sync_ms": sync_ms,
            "outer/participants": float(round_.size),
            "outer/round": float(self.manager.committed),
            "outer/syncs_committed": float(self.committed_here),
            "outer/syncs_attempted": float(self.attempted),
            "outer/bytes": float(self.bytes_sent),
            "outer/bytes_per_token": self.bytes_sent / self.tokens if self.tokens else 0.0,
            "outer/recoveries": float(self.recoveries),
            "outer/no_quorum_s": 0.0,
        } | clock.metrics()

    def _append(self, record: dict[str, Any]) -> None:
        if self.commit_log is not None:
            with self.commit_log.open("a") as fh:
                fh.write(json.dumps(record) + "\n")

    def _digest_behind(self) -> bool:
        if not self.hashes_behind:
            return False
        if self._state_bytes is None:
            self._state_bytes = sum(t.numel() * t.element_size() for t in self.heal_state.global_tensors().values())
        return self._state_bytes >= DIGEST_BEHIND_BYTES

    def _hash_behind(self) -> Future:
        """Hash the state the commit changed on the digest thread; the future holds this rank's own
        digest and the milliseconds it took (its own clock: the round's is read meanwhile)."""
        self._settle_digest()  # one held record at a time (several fragments may commit in one step)
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="digest-behind")

        def own() -> tuple[bytes, float]:
            clock = PhaseClock()
            with clock.timed("digest"):
                digest = self._own_digest()
            return digest, clock.ms["digest"]

        return self._hasher.submit(own)

    def _settle_digest(self) -> None:
        """Append the record held for its digest, once the digest is known. Called on the training
        thread before anything changes θ_g or the outer state again (the next round's start, the end,
        any digest asked for), at the same points on every rank: the group's combine is a collective."""
        if self._held is None:
            return
        record, hashing = self._held
        self._held = None
        own, record["phases_ms"]["digest"] = hashing.result()
        record["digest"] = digest = self.manager.combine_digests(own)
        self.manager.note_progress(digest=digest)
        self._append(record)

    def _record_fields(self) -> dict[str, Any]:
        """What a synchronizer adds to each commit record."""
        return {}

    def _no_quorum_metrics(self) -> dict[str, float]:
        """Said in the metrics (and so on the console), not only in the log."""
        return {"outer/no_quorum_s": self.manager.seconds_without_quorum()}

    def report(self) -> dict[str, Any]:
        """The group's outer counters and final digest for summary.json (a collective)."""
        return {
            "rounds": self.manager.committed,
            "syncs_committed": self.committed_here,
            "syncs_attempted": self.attempted,
            "bytes_sent": self.bytes_sent,
            "tokens_committed": self.tokens_committed,
            "recoveries": self.recoveries,
            "nonfinite_updates": self.nonfinite_updates,
            "diverged_updates": self.diverged_updates,
            "digest": self.group_digest(),
            "end": None if self.end is None else self.end.to_json(),
        }

    def group_digest(self) -> str:
        """sha256 over every rank's θ_g and outer-optimizer state (a collective over the group).

        Each fragment's own digest is kept until its state changes (its outer step, a heal),
        so a commit hashes the fragment it changed rather than the whole model.
        """
        self._settle_digest()
        return self.manager.combine_digests(self._own_digest())

    def _own_digest(self) -> bytes:
        """This rank's part of ``group_digest``: no collective, so it may run on the digest thread."""
        own = hashlib.sha256()
        for p in range(len(self.heal_state.global_params)):
            if p not in self._fragment_digests:
                self._fragment_digests[p] = state_digest(self.heal_state.fragment_tensors(p))
            own.update(self._fragment_digests[p])
        if self.heal_state.extra:  # the rest of the job's state (algo.auto's plan): groups agree on it too
            own.update(state_digest(self.heal_state.extra))
        return own.digest()

    def fresh_digest(self) -> str:
        """``group_digest`` hashed from scratch, no fragment's digest taken from the cache (which it
        must always equal; a collective over the group too)."""
        self._settle_digest()
        self._state_changed()
        return self.group_digest()

    def _state_changed(self, fragment: int | None = None) -> None:
        """Forget the digest of ``fragment`` (of every fragment if None): its θ_g or outer state changed."""
        assert self._held is None, "the state changed while its digest was being hashed"
        if fragment is None:
            self._fragment_digests.clear()
        else:
            self._fragment_digests.pop(fragment, None)
