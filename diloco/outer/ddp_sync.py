"""``algo=ddp``: the data-parallel baseline, in the same fault-tolerant harness.

Every inner step each worker's gradient shard (after FSDP's reduce-scatter inside the group)
is averaged over its lane, so every worker of every group applies the same gradient: plain
data parallelism across groups. A step whose round fails is skipped by that group, which is
then behind and heals from a peer at the next round.
"""

from __future__ import annotations

import logging
import time

import torch

from diloco.ft.lanes import LaneError, wait_work
from diloco.ft.state import local_tensor
from diloco.outer.codecs import Dense, launch_reduce
from diloco.outer.synchronizer import Synchronizer
from diloco.train.sync_hooks import OuterOutcome

log = logging.getLogger(__name__)


class GradientSync(Synchronizer):
    """All-reduces this worker's gradient shard across groups before every optimizer step."""

    def __init__(self, *, params: list[torch.nn.Parameter], tokens_per_step: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.params = params
        self.tokens_per_step = tokens_per_step

    def before_optimizer_step(self, step: int) -> OuterOutcome:
        """Average the gradients over the lane; a healing group contributes nothing and steps with the rest.

        There is no separate join round: a new group's first step is its join, healing in
        the round its peers are in.
        """
        started = time.perf_counter()
        outcome = OuterOutcome(skip_step=True)
        self._round_starts()
        round_ = self.manager.start_round(step - 1)
        if round_ is None:  # no quorum: no step, so no group drifts from the others
            outcome.metrics.update(self._no_quorum_metrics())
            return outcome
        ok, healed = self._heal_and_serve(round_, step - 1, step - 1)
        if round_.quorum.closing:
            # Finished groups handed over the final state (step = their last one): the trainer
            # counts this step, so it lands on theirs without an optimizer step. Nothing is committed.
            outcome.jump_to_step = None if healed is None else healed.inner_step - 1
            outcome.metrics.update(self._record(round_, False, step, 1000 * (time.perf_counter() - started)))
            return outcome
        outcome.jump_to_step = None if healed is None else healed.inner_step
        average = None
        if ok:
            average = self._reduce(round_, contribute=healed is None)
        if average is not None and self._injects("fail_round"):
            average = None
        self.attempted += 1
        committed = self.manager.commit(round_, average is not None)
        if committed:
            self._write_gradients(average)
        outcome.skip_step = not committed
        tokens = self.tokens_per_step if committed and healed is None else 0
        sync_ms = 1000 * (time.perf_counter() - started)
        outcome.metrics.update(self._record(round_, committed, step, sync_ms, tokens))
        return outcome

    def after_inner_step(self, step: int, tokens: int) -> OuterOutcome:
        self.tokens += tokens
        self._state_changed()  # θ is the live model: the optimizer step just changed it
        return OuterOutcome()

    def _reduce(self, round_, *, contribute: bool) -> torch.Tensor | None:
        with torch.no_grad():
            grads = torch.cat(
                [
                    _grad_of(p).float().cpu().flatten() if contribute else torch.zeros(local_tensor(p).numel())
                    for p in self.params
                ]
            )
        finite = not contribute or self._all_finite(grads)
        if not finite:
            grads.zero_()
            contribute = False
        pending = launch_reduce(
            round_.lane, grads, 1.0 if contribute else 0.0, Dense(), round_.size, bucket=self.bucket
        )
        if self._injects("break_lane"):
            self.manager.abandon_round()  # mid all-reduce: this round fails everywhere
        try:  # only the wait is guarded: that is where Gloo reports a lost peer; anything else is a bug
            average = pending.result(lambda work: wait_work(work, self.collective_timeout_s, round_.stop_when()))
        except LaneError as error:
            log.warning("group %s: gradient all-reduce failed: %s", self.manager.group, error)
            return None
        self.bytes_sent += pending.bytes_sent
        return average if finite else None

    @torch.no_grad()
    def _write_gradients(self, average: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            local = local_tensor(p)
            chunk = average[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local_tensor(p.grad).copy_(chunk)


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor:
    local = local_tensor(p)
    return local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local)
