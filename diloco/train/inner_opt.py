"""The inner optimizer: AdamW, Muon (MuLoCo) or plain SGD, with linear warmup then cosine decay (the DiLoCo inner loop)."""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

from diloco.config.base import ConfigError
from diloco.config.inner_opt import InnerOptConfig
from diloco.train.muon import Muon


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
    params: list[torch.nn.Parameter],
    cfg: InnerOptConfig,
    max_steps: int,
    hidden: Collection[torch.nn.Parameter] = (),
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """No weight decay on norms (1-D weights), as in Llama training. ``hidden``: the matrices inside
    the transformer blocks (``diloco.train.muon.hidden_matrices``), which ``inner_opt=muon`` steps
    with Muon; the others take AdamW there."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if cfg.name == "muon":
        optimizer: torch.optim.Optimizer = build_muon(groups, hidden, cfg)
    elif cfg.name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=cfg.lr)
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


def build_muon(groups: list[dict], hidden: Collection[torch.nn.Parameter], cfg: InnerOptConfig) -> Muon:
    """Muon on the ``hidden`` matrices among ``groups``' (a first group of their own), AdamW on the rest."""
    hidden_ids = {id(p) for p in hidden}
    muon = [p for p in groups[0]["params"] if id(p) in hidden_ids]
    if not muon:
        raise ConfigError(
            "inner_opt.name='muon': this model (or pipeline stage) has no 2-D weights inside transformer "
            "blocks for Muon to orthogonalize; use inner_opt=adamw"
        )
    groups[0]["params"] = [p for p in groups[0]["params"] if id(p) not in hidden_ids]
    return Muon(
        [{"params": muon, "muon": True, "weight_decay": cfg.weight_decay}, *groups],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        ns_steps=cfg.ns_steps,
        betas=cfg.betas,
        eps=cfg.eps,
    )


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
