"""``trainer.*``: inner-loop length, batch shape, evaluation, and ``trainer.checkpoint.*``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from diloco.config.base import check


@dataclass(frozen=True)
class CheckpointConfig:
    """``every``: save after every N inner steps, at a planned stop and at the end (0: never).
    N must be a multiple of ``algo.sync_every``, so no round is in flight when it is taken.
    ``search_dir``: where ``trainer.resume=latest`` (or ``auto``) looks for runs."""

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
    # No outer warm-up (the sync warm-up's short windows, α's ramp, the outer momentum's ramp)
    # takes more than this share of max_steps: a longer one is cut to it, the sync warm-up to
    # whole algo.sync_every windows, and the job says so at start (diloco/config/warmups.py).
    # A short job so runs at the H it was given. 1: each warm-up as configured.
    warmup_share: float = 0.2
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
    # a checkpoint, a run directory, "latest", or "auto": latest's run where one has a whole checkpoint,
    # else a fresh start (see diloco/train/checkpoint.resolve_resume)
    resume: str = ""

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
        check(
            isinstance(self.warmup_share, (int, float)) and 0 <= self.warmup_share <= 1,
            "trainer.warmup_share",
            self.warmup_share,
            "must be in [0, 1]: the most of trainer.max_steps an outer warm-up may take (1: as configured)",
        )
        check(self.eval_every >= 0, "trainer.eval_every", self.eval_every, "must be >= 0 (0: evaluate only at the end)")
        self.checkpoint.validate()
