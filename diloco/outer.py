"""The outer loop of DiLoCo and Streaming DiLoCo on top of the fault-tolerant layer.

Each worker keeps, for its own FSDP shard, the global parameters θ_g in fp32 on the CPU and
one outer optimizer per fragment. Fragment p's round: after inner step s − τ the
pseudo-gradient Δ_p = θ_g,p − θ_l,p is all-reduced over the lane (launch); after step s the
average over contributing groups is the outer gradient, the group commits only if every
rank succeeded, and θ_l,p ← α·θ_l,p + (1 − α)·θ_g,p (apply). A failed round resets
θ_l,p ← θ_g,p and leaves θ_g and the committed count as they were (DESIGN invariant 2).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from diloco.config_base import check
from diloco.fragments import fragments_to_apply, fragments_to_launch
from diloco.ft.lanes import LaneError
from diloco.ft.manager import Round, wait_work
from diloco.outer_reduce import PendingReduce, launch_reduce
from diloco.sync import OuterOutcome, Synchronizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlgoConfig:
    """H inner steps per window, P fragments, overlap τ, mixing α, payload format (DESIGN section 2).

    ``ddp`` all-reduces gradients across every worker of every group each step (the
    data-parallel baseline); ``local`` trains every group alone with no outer sync at all:
    the no-communication baseline that benchmarks measure the cost of syncing against.
    """

    name: Literal["diloco", "streaming", "ddp", "local"] = "diloco"
    sync_every: int = 50
    fragments: int = 1
    pattern: Literal["strided", "sequential"] = "strided"
    delay: int = 0
    alpha: float = 0.0
    quantize: Literal["none", "bf16", "fp8", "int8", "fp4"] = "none"
    weighting: Literal["uniform", "tokens"] = "uniform"

    def validate(self) -> None:
        if self.name == "diloco":
            check(
                self.fragments == 1, "algo.fragments", self.fragments, "must be 1 for algo=diloco; use algo=streaming"
            )
            check(self.delay == 0, "algo.delay", self.delay, "must be 0 for algo=diloco; use algo=streaming")


@dataclass
class Fragment:
    """One fragment's slice of this worker's shard: θ_l views, θ_g copies, its outer optimizer."""

    index: int
    local: list[torch.Tensor]
    global_: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    pending: PendingReduce | None = None
    round: Round | None = None
    local_ok: bool = True
    contributed: bool = False
    tokens_since_sync: int = 0


class OuterSync(Synchronizer):
    """Launches and applies fragment rounds at the steps the schedule names."""

    def __init__(self, *, algo: AlgoConfig, fragments: list[Fragment], **common: Any) -> None:
        super().__init__(**common)
        self.algo = algo
        self.fragments = fragments
        self._quorum_ms = 0.0

    def join(self) -> OuterOutcome:
        """A starting group's first round: take the live state from a peer if the job is ahead."""
        return self._advance(0, [], OuterOutcome())

    def after_inner_step(self, step: int, tokens: int) -> OuterOutcome:
        """After inner step ``step``: launch the due fragments' all-reduces, then apply due results."""
        self.tokens += tokens
        for f in self.fragments:
            f.tokens_since_sync += tokens
        due = self._schedule(fragments_to_launch, step)
        return self._advance(step, due, OuterOutcome())

    def _advance(self, step: int, due: list[int], outcome: OuterOutcome) -> OuterOutcome:
        if due or step == 0:
            healed = self._launch_round(step, due, outcome)
            if healed is not None:
                outcome.healed_to_step = step = healed
        if step > 0:
            for p in self._schedule(fragments_to_apply, step):
                outcome.metrics.update(self._apply(self.fragments[p], step))
        return outcome

    def load_global_into_local(self) -> None:
        """θ_l ← θ_g everywhere: the model to evaluate and save at the end is the global one."""
        for f in self.fragments:
            self._reset_local(f)

    def _after_heal(self) -> None:
        self.load_global_into_local()
        for f in self.fragments:
            f.tokens_since_sync = 0

    def _schedule(self, rule: Callable[[int, int, int, int], list[int]], step: int) -> list[int]:
        return rule(step, self.algo.sync_every, self.algo.fragments, self.algo.delay)

    def _launch_round(self, step: int, due: list[int], outcome: OuterOutcome) -> int | None:
        """One quorum round at inner step ``step``; returns the step we jumped to if we healed.

        A group that heals joins the round its peers are in (the fragments due at the
        peer's step) with a zero, weightless contribution (DESIGN invariant 3).
        """
        started = time.perf_counter()
        self._poll_fault_requests()
        round_ = self.manager.start_round()
        self._quorum_ms = 1000 * (time.perf_counter() - started)
        if round_ is None:
            return None  # no quorum: these fragments skip this window; θ_l trains on
        ok, healed = self._heal_and_serve(round_, step)
        if healed is not None:
            due = self._schedule(fragments_to_launch, healed) if healed > 0 else []
        for p in due:
            if ok:
                self._launch_reduce(self.fragments[p], round_, contribute=healed is None)
            else:  # the lane was dropped: this round fails here, and at the peers' all-reduce
                self.attempted += 1
                self.fragments[p].round, self.fragments[p].pending, self.fragments[p].local_ok = round_, None, False
        if not due:  # a join round moves no tensors: commit it now
            self.attempted += 1
            committed = self.manager.commit(round_, ok)
            outcome.metrics.update(self._record(round_, committed, healed or step, self._quorum_ms))
        return healed

    def _launch_reduce(self, fragment: Fragment, round_: Round, *, contribute: bool) -> None:
        """Start the lane all-reduce of Δ_p (zeros and weight 0 for a group that does not contribute)."""
        self.attempted += 1
        with torch.no_grad():
            delta = torch.cat(
                [
                    (g - local.float().cpu()).flatten() if contribute else torch.zeros(g.numel())
                    for g, local in zip(fragment.global_, fragment.local)
                ]
            )
        fragment.round, fragment.local_ok, fragment.pending = round_, True, None
        if contribute and not self._all_finite(delta):
            delta.zero_()
            contribute, fragment.local_ok = False, False
        weight = 0.0
        if contribute:
            weight = float(fragment.tokens_since_sync) if self.algo.weighting == "tokens" else 1.0
        fragment.contributed = contribute
        try:
            fragment.pending = launch_reduce(round_.lane, delta, weight, self.algo.quantize, round_.size)
            if self._take_injected("break_lane"):
                self.manager.lanes.drop()  # mid all-reduce: this round fails everywhere
        except Exception as error:  # a broken lane fails the round; it does not stop training
            log.warning("group %s: all-reduce launch failed: %s", self.manager.group, error)
            fragment.local_ok = False

    def _apply(self, fragment: Fragment, step: int) -> dict[str, float]:
        round_, pending = fragment.round, fragment.pending
        if round_ is None:
            return {}  # no quorum at launch: nothing to apply
        started = time.perf_counter()
        average = None
        if fragment.local_ok and pending is not None:
            try:
                average = pending.result(lambda work: wait_work(work, self.collective_timeout_s))
            except LaneError as error:
                log.warning("group %s: fragment %d round failed: %s", self.manager.group, fragment.index, error)
        if average is not None and self._take_injected("fail_round"):
            average = None
        committed = self.manager.commit(round_, average is not None)
        tokens = 0.0
        if committed:
            self._outer_step(fragment, average)
            self.bytes_sent += pending.bytes_sent
            if fragment.contributed:  # each fragment carries 1/P of the window's inner work
                tokens = fragment.tokens_since_sync / self.algo.fragments
        else:
            self._reset_local(fragment)
        fragment.round, fragment.pending, fragment.tokens_since_sync = None, None, 0
        sync_ms = self._quorum_ms + 1000 * (time.perf_counter() - started)
        return self._record(round_, committed, step, sync_ms, tokens)

    @torch.no_grad()
    def _outer_step(self, fragment: Fragment, average: torch.Tensor) -> None:
        """θ_g,p ← OuterOpt(θ_g,p, Δ̄_p); then θ_l,p ← α·θ_l,p + (1 − α)·θ_g,p."""
        offset = 0
        for g in fragment.global_:
            g.grad = average[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        fragment.optimizer.step()
        fragment.optimizer.zero_grad(set_to_none=True)
        alpha = self.algo.alpha
        for g, local in zip(fragment.global_, fragment.local):
            new_global = g.to(local.device, non_blocking=True).to(local.dtype)
            local.copy_(alpha * local + (1 - alpha) * new_global if alpha > 0 else new_global)

    @torch.no_grad()
    def _reset_local(self, fragment: Fragment) -> None:
        for g, local in zip(fragment.global_, fragment.local):
            local.copy_(g.to(local.device).to(local.dtype))
