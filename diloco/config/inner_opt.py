"""``inner_opt.*``: the inner optimizer of every group (AdamW by default) and its schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.base import KeysRead, check

# Which inner_opt.* keys each optimizer reads; one it does not read, set to another value than its
# default, is refused (as algo.* keys are, diloco/config/algo.py). Muon's AdamW part reads betas and eps.
_SHARED = ("lr", "weight_decay", "warmup_steps", "min_lr_ratio", "grad_clip")
READS: dict[str, tuple[str, ...]] = {
    "adamw": (*_SHARED, "betas", "eps"),
    "sgd": _SHARED,
    "muon": (*_SHARED, "betas", "eps", "momentum", "ns_steps"),
}


@dataclass(frozen=True)
class InnerOptConfig:
    """Inner-step settings; ``sgd`` (no momentum) exists for the exactness checks (docs/design.md, invariant 15).

    ``muon`` (MuLoCo, arXiv 2505.23725; ``diloco/train/muon.py``) steps the hidden matrices with Muon
    and the rest with AdamW, Muon's update scaled to AdamW's RMS so ``lr`` is the one of both.
    """

    name: Literal["adamw", "sgd", "muon"] = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    # Muon's μ (B ← μ·B + g, Nesterov update g + μ·B) and its Newton–Schulz steps.
    momentum: float = 0.95
    ns_steps: int = 5
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def validate(self) -> None:
        KEYS_READ.check(self)
        check(self.lr > 0, "inner_opt.lr", self.lr, "must be > 0")
        # Muon's update has AdamW's RMS: lr > 1 moves every hidden weight by more than its own scale per step.
        # (AdamW's lr stays open above: a test drives a job to NaN with it.)
        check(
            self.name != "muon" or self.lr <= 1,
            "inner_opt.lr",
            self.lr,
            "must be in (0, 1] with inner_opt=muon (conf/inner_opt/muon.yaml takes 0.005)",
        )
        check(self.weight_decay >= 0, "inner_opt.weight_decay", self.weight_decay, "must be >= 0")
        for i, beta in enumerate(self.betas):
            check(0 <= beta < 1, f"inner_opt.betas[{i}]", beta, "must be in [0, 1)")
        check(self.eps > 0, "inner_opt.eps", self.eps, "must be > 0")
        check(0 <= self.momentum < 1, "inner_opt.momentum", self.momentum, "must be in [0, 1) (Muon's μ)")
        check(
            isinstance(self.ns_steps, int) and self.ns_steps >= 1,
            "inner_opt.ns_steps",
            self.ns_steps,
            "must be an integer >= 1 (Newton–Schulz steps; 5 is Muon's)",
        )
        check(self.warmup_steps >= 0, "inner_opt.warmup_steps", self.warmup_steps, "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "inner_opt.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check(self.grad_clip >= 0, "inner_opt.grad_clip", self.grad_clip, "must be >= 0 (0 turns clipping off)")


KEYS_READ = KeysRead("inner_opt", InnerOptConfig, READS)
