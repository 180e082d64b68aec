"""The inner optimizer: AdamW (or plain SGD) with linear warmup then cosine decay (the DiLoCo inner loop)."""

from __future__ import annotations

import math

import torch

from diloco.config.inner_opt import InnerOptConfig


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Factor on the peak lr for optimizer step ``step`` (0-based).

    Linear warmup reaches the peak on step ``warmup_steps - 1``; cosine then decays to
    ``min_lr_ratio`` at the last step, so the first step already moves (lr > 0).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max_steps - warmup_steps
    if decay_steps <= 1:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (decay_steps - 1))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def build_inner_optimizer(
    params: list[torch.nn.Parameter], cfg: InnerOptConfig, max_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """No weight decay on norms (1-D weights), as in Llama training."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if cfg.name == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=cfg.lr)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        init_adamw_state(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step, warmup_steps=cfg.warmup_steps, max_steps=max_steps, min_lr_ratio=cfg.min_lr_ratio
        ),
    )
    return optimizer, scheduler


@torch.no_grad()
def init_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Create AdamW's per-parameter state now rather than at the first step.

    A healing group receives its peer's inner-optimizer state into tensors of the same
    names and shapes, so both must exist before any step; these are the values AdamW's own
    lazy initialisation would create.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
