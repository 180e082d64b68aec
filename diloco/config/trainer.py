"""``trainer.*``: inner-loop length, batch shape, evaluation, and ``trainer.checkpoint.*``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from diloco.config.base import check


@dataclass(frozen=True)
class CheckpointConfig:
    """``every``: save after every N inner steps, at a planned stop and at the end (0: never).
    N must be a multiple of ``algo.sync_every``, so no round is in flight when it is taken.
    ``search_dir``: where ``trainer.resume=latest`` looks for runs."""

    every: int = 0
    search_dir: str = "outputs"

    def validate(self) -> None:
        check(self.every >= 0, "trainer.checkpoint.every", self.every, "must be >= 0 (0: no checkpoints)")

    @property
    def enabled(self) -> bool:
        return self.every > 0


@dataclass(frozen=True)
class TrainerConfig:
    """Inner-loop length and batch shape.

    ``batch_size`` is sequences per worker per micro-batch, so one optimizer step of a group
    sees ``batch_size * workers_per_group * grad_accum`` sequences of ``seq_len`` tokens.

    ``activation_checkpoint``: what each transformer block keeps for its backward pass: every
    activation (``none``), only its input (``full``: the backward pass recomputes the block's
    forward), or also its matmul and attention outputs (``selective``: it recomputes only the
    cheap elementwise ops).
    ``compile``: torch.compile each block (on CPU inductor needs a C++ compiler).
    Neither changes the parameters' names or values (diloco/train/block_wrappers.py).

    ``microbatches``: with pipeline stages (``parallel.pp`` > 1), how many pieces each micro-batch
    of ``batch_size`` sequences is cut into to fill the pipeline (null: one per stage).
    """

    max_steps: int = 500
    batch_size: int = 8
    seq_len: int = 128
    grad_accum: int = 1
    eval_every: int = 250
    eval_batches: int = 8
    log_every: int = 10
    seed: int = 0
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    microbatches: int | None = None
    resume: str = ""  # a checkpoint, a run directory or "latest" (see diloco/train/checkpoint.resolve_resume)

    def validate(self) -> None:
        for key in ("max_steps", "batch_size", "seq_len", "grad_accum", "eval_batches", "log_every"):
            value = getattr(self, key)
            check(value >= 1, f"trainer.{key}", value, "must be a positive integer")
        check(
            self.microbatches is None or self.microbatches >= 1,
            "trainer.microbatches",
            self.microbatches,
            "must be a positive integer (or null: one per pipeline stage)",
        )
        check(self.eval_every >= 0, "trainer.eval_every", self.eval_every, "must be >= 0 (0: evaluate only at the end)")
        self.checkpoint.validate()
