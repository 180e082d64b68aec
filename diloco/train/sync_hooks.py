"""What the trainer asks of an outer synchronization, and what it learns back.

The trainer knows no outer algorithm: DiLoCo, Streaming DiLoCo and the data-parallel baseline
(diloco/outer/) each subclass ``SyncHooks``, and the worker hands one in (torchtitan's
composition: one trainer, docs/design.md, code style 4). ``algo=local`` trains with ``NoSync``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class OuterOutcome:
    """What the trainer learns from a synchronizer hook."""

    metrics: dict[str, float] = field(default_factory=dict)
    jump_to_step: int | None = None  # go on from this inner step: a peer's state was taken, or a window cut short
    skip_step: bool = False  # the optimizer must not step (the gradient round failed)
    end_training: bool = False  # training cannot go on (it diverged in every group): end the job now


class SyncHooks(Protocol):
    """The calls the trainer makes on its outer synchronizer, in the order of an inner loop.

    Each default is what a job without outer rounds does: nothing. A synchronizer subclasses
    this and overrides the hooks its algorithm needs.
    """

    def join(self) -> OuterOutcome:
        """Before the first inner step: join the job (a late or restarted group heals here)."""
        return OuterOutcome()

    def before_optimizer_step(self, step: int) -> OuterOutcome:
        """After the backward pass of inner step ``step``, before the optimizer steps."""
        return OuterOutcome()

    def after_inner_step(self, step: int, tokens: int) -> OuterOutcome:
        """After inner step ``step`` trained ``tokens`` tokens: launch or apply a round when due."""
        return OuterOutcome()

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics of a logged step, or an evaluation's loss, for the synchronizer's own records."""

    def between_rounds(self, step: int) -> bool:
        """Whether no round is in flight after ``step``: where a checkpoint or a planned stop leaves
        every group at the same round."""
        return True

    def finish(self, step: int) -> Any:
        """After the last inner step: stay a member until every group has finished."""

    def load_global_into_local(self) -> None:
        """Copy θ_g into the model: the result of DiLoCo is the global model."""


class NoSync(SyncHooks):
    """``algo=local`` (and a trainer built alone): no outer rounds, every hook a no-op."""
