"""The outer loop of DiLoCo and Streaming DiLoCo on top of the fault-tolerant layer.

Each worker keeps, for its own FSDP shard, the global parameters θ_g in fp32 on the CPU and
one outer optimizer per fragment. Fragment p's round: after inner step s − τ the
pseudo-gradient Δ_p = θ_g,p − θ_l,p is all-reduced over the lane (launch); after step s the
average over contributing groups is the outer gradient, the group commits only if every
rank succeeded, and θ_l,p ← α·θ_l,p + (1 − α)·θ_g,p (apply). A failed round resets
θ_l,p ← θ_g,p and leaves θ_g and the committed count as they were (docs/design.md, invariant 2).
Δ_p goes on the wire in the job's payload codec (``codecs``: dense, quantized or top-k). With
``algo.compress=topk`` each group sends a sparse payload of β·e + Δ_p and keeps the rest in its
error-feedback buffer e (``sparse.feedback``), which only a commit updates: a failed round's
Δ_p is dropped with the θ_l reset, and its residual with it.
The arithmetic of each step is ``update``'s; this module decides when and with whom.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from diloco.config.algo import AlgoConfig
from diloco.ft.lanes import LaneError, wait_work
from diloco.ft.manager import Round
from diloco.outer.codecs import launch_reduce
from diloco.outer.phases import PhaseClock
from diloco.outer.round_plan import RoundPlan
from diloco.outer.synchronizer import Synchronizer
from diloco.outer.update import contribution_weight, outer_update, pseudo_gradient, reset_local
from diloco.schedule import fragments_to_apply, fragments_to_launch, mixing_alpha, momentum, skip_target
from diloco.train.sync_hooks import OuterOutcome

log = logging.getLogger(__name__)

TAIL_ROOM = 16  # float32 slots behind each fragment's Δ in the staging buffer: the weight and the plan's extras


@dataclass
class Fragment:
    """One fragment's slice of this worker's shard: θ_l views, θ_g copies, its outer optimizer."""

    index: int
    local: list[torch.Tensor]
    global_: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    momentum: float | None = None  # the outer optimizer's configured μ (None: it has none)
    momentum_warmup_steps: int = 0  # μ ramps in over these inner steps (0: constant)
    # Per tensor of ``local``: whether this rank counts it in the group's ‖Δ̄‖. A tensor replicated
    # over a mesh dimension (tensor parallelism's norms) is counted by that dimension's rank 0 only.
    owned: list[bool] | None = None  # None: every tensor (a worker that holds them alone)
    tokens_since_sync: int = 0
    # The codec's error-feedback buffer e (flat fp32, CPU; None: the codec keeps none). Local state
    # (docs/design.md, invariant 10): checkpointed, never healed from a peer nor in the digest.
    error: torch.Tensor | None = None


@dataclass
class Flight:
    """One round between its launch (inner step ``launch_step``) and its apply (τ steps later).

    Filled in by the round's background thread; read by the training thread only once that
    thread is done. ``averages`` stays None while the reduce has not run: the round found no
    quorum, or it involves this group in a healing transfer, which waits for the apply step.
    """

    launch_step: int
    fragments: list[Fragment]
    deltas: list[torch.Tensor]
    weights: list[float]
    round: Round | None = None
    averages: list[torch.Tensor | None] | None = None
    bytes_sent: list[int] = field(default_factory=list)
    errors: list[torch.Tensor | None] = field(default_factory=list)  # each fragment's e if it commits
    held_ms: float = 0.0  # time the training thread spent on this round
    done: Future | None = None
    measured: torch.Tensor | None = None  # the plan's measurements from this group, sent with the first fragment
    shared: torch.Tensor | None = None  # every group's, summed over the lane
    unweighted: bool = False  # a reduce completed with Σ_m w_m = 0: no group of the round contributed
    clock: PhaseClock = field(default_factory=PhaseClock)  # the round's phases so far
    staging: list[torch.Tensor | None] = field(default_factory=list)  # the buffer each Δ heads (``OuterSync._stage``)


class OuterSync(Synchronizer):
    """Launches rounds at the steps the schedule names and applies them τ steps later.

    With τ > 0 a launch only snapshots Δ on the training thread; the quorum, the non-finite
    check, the quantization and the all-reduce run on a background thread while the next τ
    inner steps train, so overlap hides the wait for the other groups as well as the
    transfer. A round that makes this group send or receive state is finished on the
    training thread at the apply step, where the state is consistent (a healing peer waits
    up to τ steps for it). θ_g is a copy the inner steps never touch, so a large one is hashed
    beside them (``Synchronizer.hashes_behind``).
    """

    hashes_behind = True

    def __init__(
        self,
        *,
        algo: AlgoConfig,
        fragments: list[Fragment],
        plan: RoundPlan,
        max_steps: int,
        **common: Any,
    ) -> None:
        """``plan``: the rounds' τ and payload codec (``round_plan``; algo.auto's keeps its plan tensor in
        ``heal_state.extra``). ``algo`` stays the job's config; ``max_steps``, the job's last step, where
        its last round falls (``diloco.schedule.LastWindow`` when it ends no window)."""
        super().__init__(**common)
        self.algo = algo
        self.fragments = fragments
        self.warmup = algo.sync_warmup_window()  # from the configured τ: algo.auto keeps τ below H₀/P
        self.max_steps = max_steps
        self.plan = plan
        for f in fragments:
            f.error = plan.codec.error_buffer(sum(g.numel() for g in f.global_))
        self._flight: Flight | None = None
        self._staging = torch.empty(0)  # the launched fragments' Δ, reused every round (``_stage``)
        self.rounds_nobody_finite = 0  # in a row: every member of the round sent a non-finite Δ, this group too

    def join(self) -> OuterOutcome:
        """A starting group's first round: take the live state from a peer if the job is ahead."""
        outcome = OuterOutcome()
        started = time.perf_counter()
        self._round_starts()
        flight = Flight(launch_step=0, fragments=[], deltas=[], weights=[], round=self.manager.start_round(0))
        flight.held_ms = 1000 * (time.perf_counter() - started)
        self._land(flight, 0, outcome)
        return outcome

    def after_inner_step(self, step: int, tokens: int) -> OuterOutcome:
        """After inner step ``step``: launch the due fragments' round, then apply the round due now."""
        self.tokens += tokens
        for f in self.fragments:
            f.tokens_since_sync += tokens
        self.plan.step_ends()
        outcome = OuterOutcome()
        if self.algo.window == "time" and self._flight is None:
            step = self._end_window_early(step, outcome)
        due = self._schedule(fragments_to_launch, step)
        if due:
            self._launch(step, due)
        flight = self._flight
        if flight is not None and self._schedule(fragments_to_apply, step):  # the flight launched τ steps ago
            self._flight = None
            self._land(flight, step, outcome)
        self.plan.step_begins()
        return outcome

    def _end_window_early(self, step: int, outcome: OuterOutcome) -> int:
        """Time-bounded windows: if the peers opened this group's next round and it is more than
        a step away, skip to it (the inner steps not taken are not made up: this group counts
        by the tokens it trained, and its lr schedule and data position follow the round's step)."""
        algo = self.algo
        target = skip_target(
            step,
            self.manager.open_round_step(),
            algo.sync_every,
            algo.fragments,
            self.plan.delay,
            self.warmup,
            self.max_steps,
        )
        if target != step:
            log.debug(
                "group %s: round open at inner step %d; ending the window at %d", self.manager.group, target, step
            )
            outcome.jump_to_step = target
        return target

    def between_rounds(self, step: int) -> bool:
        """After a fragment's apply step nothing is in flight (τ < H/P): the next launch is later."""
        return self._flight is None and bool(self._schedule(fragments_to_apply, step))

    def progress_state(self) -> dict[str, Any]:
        return super().progress_state() | {"tokens_since_sync": [f.tokens_since_sync for f in self.fragments]}

    def load_progress_state(self, state: dict[str, Any]) -> None:
        super().load_progress_state(state)
        for fragment, tokens in zip(self.fragments, state["tokens_since_sync"], strict=True):
            fragment.tokens_since_sync = int(tokens)
        self.plan.follow()  # the checkpoint's tensors (loaded first) hold the plan

    def load_global_into_local(self) -> None:
        """θ_l ← θ_g everywhere: the model to evaluate and save at the end is the global one."""
        for f in self.fragments:
            reset_local(f.global_, f.local)

    def _errors(self) -> dict[str, torch.Tensor]:
        """Each fragment's e, by its checkpoint key (none when the codec keeps no e)."""
        return {f"error.{f.index}": f.error for f in self.fragments if f.error is not None}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return super().checkpoint_tensors() | self._errors()

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_checkpoint_tensors({k: v for k, v in tensors.items() if not k.startswith("error.")})
        for key, error in self._errors().items():
            error.copy_(tensors[key])

    def _after_heal(self) -> None:
        """Take up the peer's state. e starts at zero: it was this group's residual of rounds it did
        not contribute to, made against a θ_g it no longer holds, and a peer's e is the peer's own."""
        self.load_global_into_local()
        for f in self.fragments:
            f.tokens_since_sync = 0
        for error in self._errors().values():
            error.zero_()
        self.plan.follow()

    def _record_fields(self) -> dict[str, Any]:
        return self.plan.record_fields()

    def _schedule(self, rule: Callable[..., list[int]], step: int) -> list[int]:
        return rule(step, self.algo.sync_every, self.algo.fragments, self.plan.delay, self.warmup, self.max_steps)

    def _launch(self, step: int, due: list[int]) -> None:
        """Snapshot Δ_p = θ_g,p − θ_l,p of the due fragments and start their round in the background."""
        started = time.perf_counter()
        self._round_starts()
        fragments = [self.fragments[p] for p in due]
        clock = PhaseClock()
        staging = self._stage(fragments)
        with clock.timed("delta"):
            deltas = [pseudo_gradient(f.global_, f.local, out) for f, out in zip(fragments, staging)]
        weights = [contribution_weight(self.algo.weighting, f.tokens_since_sync) for f in fragments]
        flight = Flight(launch_step=step, fragments=fragments, deltas=deltas, weights=weights, clock=clock)
        flight.staging = staging
        flight.measured = self.plan.measurements()
        if self.plan.delay > 0:
            flight.done = run_in_background(lambda: self._quorum_and_reduce(flight), f"outer-round-{step}")
        else:  # applied right away: nothing to overlap, so no thread
            self._quorum_and_reduce(flight)
        flight.held_ms = 1000 * (time.perf_counter() - started)
        self._flight = flight

    def _stage(self, fragments: list[Fragment]) -> list[torch.Tensor]:
        """Each launched fragment's staging buffer: room for its Δ and ``TAIL_ROOM`` behind, carved from
        one buffer that grows to the most ever launched at once and is reused every round, so a round
        allocates nothing of the model's size. One flight at a time (τ < H/P): the buffer is free again
        once the previous round has been applied."""
        sizes = [sum(g.numel() for g in f.global_) + TAIL_ROOM for f in fragments]
        if self._staging.numel() < sum(sizes):
            self._staging = torch.empty(0)  # the old buffer goes before the larger one is made
            self._staging = torch.empty(sum(sizes), dtype=torch.float32, device=fragments[0].global_[0].device)
        return list(self._staging[: sum(sizes)].split(sizes))

    def _quorum_and_reduce(self, flight: Flight) -> None:
        """The part of a round that overlaps inner steps: the quorum, then the reduce.

        No reduce when a healing transfer involves this group, or in a closing round.
        """
        with flight.clock.timed("quorum"):
            flight.round = round_ = self.manager.start_round(flight.launch_step)
        if round_ is None or round_.quorum.closing or round_.heal_source is not None or round_.heal_targets:
            return
        self._reduce(flight)

    def _reduce(self, flight: Flight) -> None:
        """Reduce every fragment's weighted Δ over the lane in the job's codec and average; None where
        it failed. The codec also leaves the e each fragment keeps if it commits (``Flight.errors``).

        A Δ that is not finite on some rank of the group goes out as zeros with weight 0:
        the others' average is untouched, and this group does not commit (docs/design.md, invariant 4).
        """
        round_ = flight.round
        local_ok, pending = [], []
        started = time.perf_counter()
        for i, (delta, weight) in enumerate(zip(flight.deltas, flight.weights)):
            with flight.clock.timed("finite"):
                finite = weight == 0.0 or self._all_finite(delta)
            if not finite:
                delta.zero_()
            # Not guarded: Gloo reports a broken lane when the collective is waited on (a
            # failed round); an error here is a bug, and it stops the worker with its traceback.
            extras = flight.measured if i == 0 else None
            weight, error = (weight if finite else 0.0), flight.fragments[i].error
            codec, staging = self.plan.codec, flight.staging[i] if flight.staging else None
            reduce = launch_reduce(
                round_.lane, delta, weight, codec, round_.size, error, extras, self.bucket, flight.clock, staging
            )
            pending.append(reduce)
            local_ok.append(finite)
        flight.errors = [reduce.error for reduce in pending]
        if self._injects("break_lane"):
            self.manager.abandon_round()  # mid all-reduce: this round fails everywhere
        if self._injects("stop_in_round"):
            os.kill(os.getpid(), signal.SIGSTOP)  # hung mid all-reduce, until someone sends SIGCONT
        flight.averages = []
        for ok, reduce in zip(local_ok, pending):
            average = None
            try:
                wait = lambda work: wait_work(work, self.collective_timeout_s, round_.stop_when())  # noqa: E731
                average = reduce.result(wait, flight.clock)
                flight.unweighted |= average is None
            except LaneError as error:
                log.warning("group %s: round %s failed: %s", self.manager.group, round_.quorum.quorum_id, error)
                self._staging = torch.empty(0)  # a collective given up on may still write into it: never reuse it
            flight.averages.append(average if ok else None)
            flight.bytes_sent.append(reduce.bytes_sent)
        flight.shared = pending[0].extras
        self.manager.note_round_bytes(sum(flight.bytes_sent))  # what a slow link would hold up (diloco.ft.reach)
        if all(a is not None for a in flight.averages):
            self.plan.transferred(time.perf_counter() - started, sum(flight.bytes_sent))

    def _land(self, flight: Flight, step: int, outcome: OuterOutcome) -> None:
        """At the apply step, on the training thread: wait for the round, heal or serve if asked, commit."""
        started = time.perf_counter()
        if flight.done is not None:
            self._wait_background(flight)
        round_ = flight.round
        if round_ is None:  # no quorum: these fragments skip this window; θ_l trains on
            outcome.metrics.update(self._no_quorum_metrics())
            return
        if round_.quorum.closing:
            self._take_final_state(flight, step, outcome, started)
            return
        if flight.averages is None:  # a healing transfer involves us: do it now, then reduce
            with flight.clock.timed("heal"):
                ok, healed = self._heal_and_serve(round_, step, flight.launch_step)
            if healed is not None:
                step = outcome.jump_to_step = healed.inner_step
                flight = self._joining_flight(round_, healed.round_step, flight.clock)
            if not flight.fragments:  # a join round moves no tensors and commits no new state
                self.manager.settle(ok)
                sync_ms = flight.held_ms + 1000 * (time.perf_counter() - started)
                outcome.metrics.update(self._record(round_, False, step, sync_ms, join=True, clock=flight.clock))
                return
            if ok:
                self._reduce(flight)
            else:  # the lane was dropped: this round fails here, and at the peers' all-reduce
                flight.averages = [None] * len(flight.fragments)
                flight.bytes_sent = [0] * len(flight.fragments)
        applied = [self._apply(flight, i, step, started) for i in range(len(flight.fragments))]
        for metrics in applied:
            outcome.metrics.update(metrics)
        outcome.end_training = self._diverged(flight)
        if all(m["outer/committed"] for m in applied):
            self.plan.after_round(flight.shared, round_.size, self.manager)

    def _diverged(self, flight: Flight) -> bool:
        """Whether ``algo.diverged_rounds`` rounds in a row had no finite Δ from any group.

        Every member of a round reads the same Σ_m w_m, so all of them count the same rounds
        and end together; a group that ends hands the others the job's last committed θ_g in
        closing rounds, so they end too. One group's NaN never counts (its peers contribute),
        nor does a planned one (``diverged_updates`` leaves those out).
        """
        self.rounds_nobody_finite = self.rounds_nobody_finite + 1 if flight.unweighted and self.diverged_updates else 0
        limit = self.algo.diverged_rounds
        if not limit or self.rounds_nobody_finite < limit:
            return False
        log.error(
            "group %s: no group sent a finite update in the last %d rounds (algo.diverged_rounds): training "
            "diverged; ending the job with the last committed model",
            self.manager.group,
            self.rounds_nobody_finite,
        )
        return True

    def _take_final_state(self, flight: Flight, step: int, outcome: OuterOutcome, started: float) -> None:
        """Groups that finished hand this group the job's final state; it takes it and stops training.

        A closing round commits nothing: the state it moves is already the job's last
        committed one. If the transfer failed, this round's fragments start over from θ_g.
        """
        _, healed = self._heal_and_serve(flight.round, step, flight.launch_step)
        if healed is not None:
            step = outcome.jump_to_step = healed.inner_step
        else:
            for fragment in flight.fragments:
                reset_local(fragment.global_, fragment.local)
        sync_ms = flight.held_ms + 1000 * (time.perf_counter() - started)
        outcome.metrics.update(self._record(flight.round, False, step, sync_ms))

    def _joining_flight(self, round_: Round, round_step: int, clock: PhaseClock) -> Flight:
        """After healing: the peers' round, which this group joins with zeros and weight 0
        (docs/design.md, invariant 3); ``clock`` goes on timing the round."""
        due = self._schedule(fragments_to_launch, round_step) if round_step > 0 else []
        fragments = [self.fragments[p] for p in due]
        deltas = [torch.zeros(sum(g.numel() for g in f.global_)) for f in fragments]
        return Flight(
            launch_step=round_step,
            fragments=fragments,
            deltas=deltas,
            weights=[0.0] * len(due),
            round=round_,
            measured=self.plan.nothing_measured(),
            clock=clock,
        )

    def _wait_background(self, flight: Flight) -> None:
        """Wait for the round's background part; every wait in it has its own timeout, this is a backstop."""
        timeout_s = self.manager.start_round_timeout_s + 4 * self.collective_timeout_s
        try:
            flight.done.result(timeout=timeout_s)
        except FutureTimeout:
            raise RuntimeError(
                f"group {self.manager.group}: the outer round launched at inner step {flight.launch_step} "
                f"is still running after {timeout_s:.0f}s (timeouts.quorum, connect and collective bound its waits)"
            ) from None

    def _apply(self, flight: Flight, i: int, step: int, started: float) -> dict[str, float]:
        """Commit the flight's i-th fragment iff every rank has its average: then the outer step, else reset θ_l."""
        fragment, average = flight.fragments[i], flight.averages[i]
        clock = flight.clock.copy()  # the flight's phases, then this fragment's own
        self.attempted += 1
        if average is not None and self._injects("fail_round"):
            average = None
        with clock.timed("commit"):
            committed = self.manager.commit(flight.round, average is not None)
        tokens = 0.0
        schedule = {}
        if committed:
            with clock.timed("outer_step"):
                schedule = self._outer_step(fragment, average, flight.launch_step, flight.round.size)
            if fragment.error is not None:  # e as the round left it: what it holds back beside Δ̄
                fragment.error.copy_(flight.errors[i])
                schedule["outer/error_norm"] = math.sqrt(
                    self.manager.sum_over_ranks(owned_square_sum(fragment.error, fragment))
                )
            self.bytes_sent += flight.bytes_sent[i]
            if flight.weights[i] > 0:  # each fragment carries 1/P of the window's inner work
                tokens = fragment.tokens_since_sync / self.algo.fragments
        else:
            reset_local(fragment.global_, fragment.local)
        fragment.tokens_since_sync = 0
        sync_ms = flight.held_ms + 1000 * (time.perf_counter() - started)
        return self._record(flight.round, committed, step, sync_ms, tokens, clock=clock) | schedule

    def _outer_step(self, fragment: Fragment, average: torch.Tensor, launch_step: int, groups: int) -> dict[str, float]:
        """``outer_update`` with this round's α and μ (``_warmed_up``); returns them with the
        fragment's ‖Δ̄‖ over the whole group (a collective), as metrics."""
        alpha, mu = self._warmed_up(fragment, launch_step, groups)
        squares = self.manager.sum_over_ranks(owned_square_sum(average, fragment))
        self._settle_digest()  # the step changes the θ_g a previous commit's digest may still be hashing
        outer_update(fragment.global_, fragment.local, average, fragment.optimizer, alpha, mu)
        self._state_changed(fragment.index)
        schedule = {"outer/pseudo_grad_norm": math.sqrt(squares), "outer/alpha": alpha}
        return schedule | ({"outer/momentum": float(mu)} if mu is not None else {})

    def _warmed_up(self, fragment: Fragment, launch_step: int, groups: int) -> tuple[float, float | None]:
        """α(s, M) and μ(s) (``diloco/schedule.py``) for a round launched after inner step s with M
        groups (μ None: an optimizer without momentum).

        Both read only the round's launch step and group count, which every group of the
        round shares (a healing group joins its peers' round), so all groups step alike.
        """
        algo, mu = self.algo, fragment.momentum
        alpha = mixing_alpha(launch_step, groups, algo.alpha, algo.alpha_warmup_steps, algo.alpha_reference_groups)
        if mu is not None and fragment.momentum_warmup_steps:
            mu = momentum(launch_step, mu, fragment.momentum_warmup_steps)
        return alpha, mu


def owned_square_sum(average: torch.Tensor, fragment: Fragment) -> float:
    """Σ Δ̄² over the entries of this rank's shard that it alone counts (``Fragment.owned``):
    summed over the group's ranks, the square of the whole fragment's ‖Δ̄‖ whatever the layout."""
    owned = fragment.owned or [True] * len(fragment.local)
    total, offset = 0.0, 0
    for tensor, counted in zip(fragment.local, owned, strict=True):
        if counted:
            values = average[offset : offset + tensor.numel()]
            total += torch.dot(values, values).item()  # no temporary the size of the tensor
        offset += tensor.numel()
    return total


def run_in_background(work: Callable[[], None], name: str) -> Future:
    """Run ``work`` on a daemon thread; the future carries its exception, if any, to the waiter."""
    done: Future = Future()

    def target() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - handed to the training thread, which re-raises
            done.set_exception(error)
        else:
            done.set_result(None)

    threading.Thread(target=target, name=name, daemon=True).start()
    return done
