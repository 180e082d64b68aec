"""``inner_opt.*``: the inner optimizer of every group (AdamW by default) and its schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.base import check


@dataclass(frozen=True)
class InnerOptConfig:
    """Inner-step settings; ``sgd`` (no momentum) exists for the exactness checks (docs/design.md, invariant 15)."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def validate(self) -> None:
        check(self.lr > 0, "inner_opt.lr", self.lr, "must be > 0")
        check(self.weight_decay >= 0, "inner_opt.weight_decay", self.weight_decay, "must be >= 0")
        for i, beta in enumerate(self.betas):
            check(0 <= beta < 1, f"inner_opt.betas[{i}]", beta, "must be in [0, 1)")
        check(self.eps > 0, "inner_opt.eps", self.eps, "must be > 0")
        check(self.warmup_steps >= 0, "inner_opt.warmup_steps", self.warmup_steps, "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "inner_opt.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check(self.grad_clip >= 0, "inner_opt.grad_clip", self.grad_clip, "must be >= 0 (0 turns clipping off)")
