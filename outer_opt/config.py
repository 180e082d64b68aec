"""``OuterOptConfig``: the ``outer_opt.*`` keys, one flat dataclass for every registered optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.config.base import check
from outer_opt.registry import available


@dataclass(frozen=True)
class OuterOptConfig:
    """Which outer optimizer steps θ_g with Δ̄, and its hyperparameters.

    Each optimizer reads only the fields it uses (its builder's docstring lists them); the
    others are ignored. The defaults are DiLoCo's: SGD with Nesterov momentum, lr 0.7,
    momentum 0.9 (arXiv 2311.08105, section 3), with the momentum warmed up over the first
    500 inner steps (this project's recipe for training from scratch). ``nesterov`` is read
    by ``sgd`` (the yaml preset sets it false: heavy-ball momentum) and must stay true for
    ``nesterov``. ``eps``
    defaults to 0.1, the value the DiLoCo paper found stable for an outer Adam.
    ``momentum_warmup_steps`` (read by ``nesterov`` and ``sgd``) ramps the momentum linearly
    from 0 over the job's first inner steps (``outer_opt.warmup``); 0 is the paper's constant μ.
    """

    name: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 0.1
    weight_decay: float = 0.0
    momentum_warmup_steps: int = 500

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first ``outer_opt.*`` key that cannot build an optimizer."""
        names = available()
        check(
            self.name in names,
            "outer_opt.name",
            self.name,
            f"must be one of {', '.join(names)}; add one with outer_opt.register",
        )
        check(math.isfinite(self.lr) and self.lr > 0, "outer_opt.lr", self.lr, "must be > 0")
        check(0 <= self.momentum < 1, "outer_opt.momentum", self.momentum, "must be in [0, 1)")
        check(len(self.betas) == 2, "outer_opt.betas", self.betas, "must be a list of 2 values")
        for i, beta in enumerate(self.betas):
            check(0 <= beta < 1, f"outer_opt.betas[{i}]", beta, "must be in [0, 1)")
        check(
            math.isfinite(self.eps) and self.eps > 0,
            "outer_opt.eps",
            self.eps,
            "must be > 0 (a parameter whose pseudo-gradient is always 0 would otherwise divide 0 by 0)",
        )
        check(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "outer_opt.weight_decay",
            self.weight_decay,
            "must be >= 0",
        )
        check(
            self.momentum_warmup_steps >= 0,
            "outer_opt.momentum_warmup_steps",
            self.momentum_warmup_steps,
            "must be >= 0 (0: the momentum is constant from the first round)",
        )
        check(
            self.name != "nesterov" or self.nesterov,
            "outer_opt.nesterov",
            self.nesterov,
            "outer_opt.name='nesterov' always uses Nesterov momentum; use outer_opt=sgd for heavy-ball momentum",
        )
        check(
            self.name not in ("nesterov", "sgd") or not self.nesterov or self.momentum > 0,
            "outer_opt.momentum",
            self.momentum,
            "Nesterov momentum needs outer_opt.momentum > 0; raise it "
            "or use outer_opt=sgd with outer_opt.nesterov=false",
        )
