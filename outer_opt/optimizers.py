"""The built-in outer optimizers: torch.optim's SGD and Adam, and a few from torch-optimizer.

Each builder creates the optimizer's per-parameter state eagerly, with exactly the values
its own lazy initialisation would use, so state names never change (see ``registry``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch_optimizer

from outer_opt.config import OuterOptConfig
from outer_opt.registry import Params, initialize_state, register


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _momentum_state(p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
    # torch's SGD starts the buffer as a copy of the first gradient; a zero buffer gives
    # momentum·0 + g = g, the same value (only the sign of a zero can differ).
    return {"momentum_buffer": _zeros(p)} if group["momentum"] != 0 else {}


class InPlaceSGD(torch.optim.SGD):
    """torch.optim.SGD's arithmetic, bit for bit, with ``p.grad`` as its scratch.

    torch's single-tensor step (its CPU path) makes the Nesterov direction g + μ·b, and with weight
    decay g + λ·θ, as new tensors of each parameter's size: at the model's size that is a second
    copy of Δ̄ per round, in fresh pages. Here the same operations in the same order write into
    ``p.grad`` (Δ̄, which the caller hands over to be overwritten), so a step allocates nothing.
    """

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        assert closure is None, "the outer step takes no closure"
        for group in self.param_groups:
            lr, mu, dampening = group["lr"], group["momentum"], group["dampening"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.neg_() if group["maximize"] else p.grad
                if group["weight_decay"] != 0:
                    grad.add_(p, alpha=group["weight_decay"])
                if mu != 0:
                    buf = self.state[p].get("momentum_buffer")
                    if buf is None:
                        buf = self.state[p]["momentum_buffer"] = grad.detach().clone()
                    else:
                        buf.mul_(mu).add_(grad, alpha=1 - dampening)
                    grad = grad.add_(buf, alpha=mu) if group["nesterov"] else buf
                p.add_(grad, alpha=-lr)


def _sgd(params: Params, lr: float, momentum: float, nesterov: bool, weight_decay: float) -> torch.optim.Optimizer:
    opt = InPlaceSGD(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    return initialize_state(opt, _momentum_state)


@register("nesterov")
def build_nesterov(params: Params, cfg: OuterOptConfig) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum, DiLoCo's outer optimizer. Reads lr, momentum, weight_decay."""
    return _sgd(params, cfg.lr, cfg.momentum, True, cfg.weight_decay)


@register("sgd")
def build_sgd(params: Params, cfg: OuterOptConfig) -> torch.optim.Optimizer:
    """SGD with heavy-ball momentum (Nesterov if cfg.nesterov). Reads lr, momentum, nesterov, weight_decay."""
    return _sgd(params, cfg.lr, cfg.momentum, cfg.nesterov, cfg.weight_decay)


@register("avg")
def build_avg(params: Params, cfg: OuterOptConfig) -> torch.optim.Optimizer:
    """Parameter averaging: SGD with lr fixed at 1 and no momentum, ignoring every cfg field.

    θ_g ← θ_g − Δ̄ = θ_g − mean_i(θ_g − θ_l,i) = mean_i(θ_l,i): plain averaging of the
    groups' models (federated averaging), a special case that holds exactly (docs/design.md, invariant 15).
    """
    return _sgd(params, 1.0, 0.0, False, 0.0)


def _adam_state(p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
    # As torch.optim.Adam's lazy init on a non-fused, non-capturable group: ``step`` is a
    # CPU scalar tensor, float64 only when the default dtype is.
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    state = {"step": torch.tensor(0.0, dtype=step_dtype, device="cpu"), "exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = _zeros(p)
    return state


@register("adam")
def build_adam(params: Params, cfg: OuterOptConfig) -> torch.optim.Optimizer:
    """torch.optim.Adam (L2 weight decay). Reads lr, betas, eps (0.1 in DiLoCo's outer Adam), weight_decay."""
    opt = torch.optim.Adam(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False, fused=False
    )
    return initialize_state(opt, _adam_state)


def _moments_state(p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
    # torch-optimizer keeps ``step`` as a Python int.
    return {"step": 0, "exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)}


@register("lamb")
def build_lamb(params: Params, cfg: OuterOptConfig) -> torch.optim.Optimizer:
    """torch_optimizer.Lamb: Adam's direction scaled per tensor by ‖θ‖/‖step‖. Reads lr, betas, eps, weight_decay.

    Its state entries weight_norm, adam_norm and trust_ratio are diagnostics rewritten on
    every step and never read; ``optimizer_state_tensors`` leaves them out.
    """
    opt = torch_optimizer.Lamb(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return initialize_state(opt, _moments_state)


@register("adabelief")
def build_adabelief(params: Params, cfg: OuterOptConfig) -> torch.optim.Optimizer:
    """torch_optimizer.AdaBelief (L2 weight decay, no rectification). Reads lr, betas, eps, weight_decay.

    With weight_decay > 0 it adds θ·weight_decay to ``p.grad`` in place, so Δ̄ is changed.
    """
    opt = torch_optimizer.AdaBelief(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    def make(p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        beta2 = group["betas"][1]
        state = {"rho_inf": 2.0 / (1.0 - beta2) - 1.0, "step": 0, "exp_avg": _zeros(p), "exp_avg_var": _zeros(p)}
        if group["amsgrad"]:
            state["max_exp_avg_var"] = _zeros(p)
        return state

    return initialize_state(opt, make)


@register("radam")
def build_radam(params: Params, cfg: OuterOptConfig) -> torch.optim.Optimizer:
    """torch_optimizer.RAdam: Adam with its variance rectified in early steps. Reads lr, betas, eps, weight_decay.

    Its per-group ``buffer`` is a cache of values recomputed from the step count, so it is
    not state that needs to travel.
    """
    opt = torch_optimizer.RAdam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return initialize_state(opt, _moments_state)


@register("yogi")
def build_yogi(params: Params, cfg: OuterOptConfig) -> torch.optim.Optimizer:
    """torch_optimizer.Yogi: Adam with an additive second-moment update. Reads lr, betas, eps, weight_decay."""
    opt = torch_optimizer.Yogi(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    def make(p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        start = group["initial_accumulator"]
        return {
            "step": 0,
            "exp_avg": torch.full_like(p, start, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.full_like(p, start, memory_format=torch.preserve_format),
        }

    return initialize_state(opt, make)
