"""The outer update of DiLoCo and Streaming DiLoCo, as functions of tensors only.

For one fragment p (the whole model when P = 1) and the groups m that contribute to its round,
in the papers' symbols (DiLoCo, arXiv 2311.08105, Algorithm 1; Streaming DiLoCo,
arXiv 2501.18512, whose mixing factor α merges the global model into each group's own):

    θ_g    = θ_l at the start, fp32 on the CPU     ``global_copy``
    Δ_m    = θ_g − θ_l,m, fp32                     ``pseudo_gradient``
    w_m    = 1, or m's tokens since the last sync  ``contribution_weight``
    Δ̄      = Σ_m w_m·Δ_m / Σ_m w_m                 ``weighted_mean`` (the lane sums w_m·Δ_m and w_m)
    θ_g    ← OuterOpt(θ_g, Δ̄)                      ``outer_update``: Δ̄ is θ_g's gradient
    θ_l,m  ← α·θ_l,m + (1 − α)·θ_g                 ``outer_update``; α = 0 is DiLoCo's θ_l ← θ_g

Nothing here communicates, reads a config, keeps state or logs. The synchronizers do the
rest and call these for the arithmetic: the all-reduce and the quorum (``codecs``,
``diloco_sync``, ``ddp_sync``), the non-finite guard (a group whose Δ is not finite sends
zeros with w = 0), and the schedules of μ and α (``diloco/schedule.py``). tests/outer/test_update.py
checks the closed forms on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch


@torch.no_grad()
def global_copy(theta_l: Sequence[torch.Tensor], pin_memory: bool) -> list[torch.nn.Parameter]:
    """θ_g ← θ_l at the start of training: an fp32 copy on the CPU, as Parameters for the outer optimizer.

    fp32 whatever θ_l's dtype, so small outer steps are not rounded away; ``pin_memory``
    (with a CUDA model) lets ``outer_update`` copy θ_g back to the device without blocking.
    """
    global_ = []
    for tensor in theta_l:
        copy = tensor.float().cpu().clone()
        global_.append(torch.nn.Parameter(copy.pin_memory() if pin_memory else copy))
    return global_


@torch.no_grad()
def pseudo_gradient(
    theta_g: Sequence[torch.Tensor], theta_l: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Δ = θ_g − θ_l of one fragment, flattened into one fp32 vector on θ_g's device.

    θ_l (the model's tensors: any dtype, any device) is cast to fp32 and brought to θ_g's
    device (the CPU) first, so a bf16 model's Δ keeps fp32 precision against the fp32 θ_g.
    Δ points from θ_l to θ_g: a descent step on it moves θ_g towards θ_l. ``out``: a flat
    fp32 buffer on θ_g's device with room for Δ (a fragment's staging buffer, reused every
    round), written without a temporary; Δ is its head. Either way the bits are the same.
    """
    if out is None:
        return torch.cat([(g - local.float().cpu()).flatten() for g, local in zip(theta_g, theta_l, strict=True)])
    offset = 0
    for g, local in zip(theta_g, theta_l, strict=True):
        view = out[offset : offset + g.numel()]
        if local.dtype == view.dtype and local.device == view.device:
            torch.sub(g.reshape(-1), local.reshape(-1), out=view)  # one pass: nothing to cast or bring over
        else:
            view.copy_(local.reshape(-1))  # cast to fp32 and brought over, in place
            torch.sub(g.reshape(-1), view, out=view)
        offset += g.numel()
    return out[:offset]


def contribution_weight(weighting: Literal["uniform", "tokens"], tokens: int) -> float:
    """w_m, the weight of group m's Δ_m in Δ̄ (``algo.weighting``).

    ``uniform``: 1, every contributing group alike (the papers' mean over groups); ``tokens``:
    the tokens the group trained on since this fragment's last sync, so a group that took
    fewer inner steps in a time-bounded window counts for less.
    """
    return float(tokens) if weighting == "tokens" else 1.0


def weighted_mean(summed: torch.Tensor, total_weight: float) -> torch.Tensor | None:
    """Δ̄ = Σ_m w_m·Δ_m / Σ_m w_m, from the two sums the lane's all-reduce returns, divided in
    place: ``summed`` is the reduce's own buffer.

    None when no group contributed (Σ_m w_m = 0: every group healing or non-finite), so
    there is nothing to step with. A group with w_m = 0 leaves the others' Δ̄ untouched.
    """
    if total_weight <= 0:
        return None
    return summed.div_(total_weight)


@torch.no_grad()
def outer_update(
    theta_g: Sequence[torch.nn.Parameter],
    theta_l: Sequence[torch.Tensor],
    mean_delta: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    alpha: float,
    momentum: float | None = None,
) -> None:
    """One fragment's outer step, in place: θ_g ← OuterOpt(θ_g, Δ̄), then θ_l ← α·θ_l + (1 − α)·θ_g.

    ``theta_g``: the fp32 global parameters, which ``optimizer`` (``outer_opt``'s, built over
    exactly these) steps; ``theta_l``: the model's tensors of the same fragment, in the same
    order (views into the model, written in place in their own dtype and device);
    ``mean_delta``: Δ̄ flattened in that order, as ``pseudo_gradient`` lays Δ out; the optimizer
    may write to it (pass a copy to keep it).

    Δ̄ is θ_g's gradient for one optimizer step (``.grad`` views into ``mean_delta``, no
    copy of the model's size), so outer SGD with lr 1 and no momentum gives θ_g − Δ̄ = mean_m θ_l,m
    (parameter averaging) and Nesterov SGD gives DiLoCo's default outer step. Then each
    group keeps α of its own θ_l (Streaming DiLoCo's mixing): α = 0 is DiLoCo's reset
    θ_l ← θ_g, α = 1 keeps θ_l as it was. α and this round's μ (``momentum``, set on every
    param group that has a momentum; None: the optimizer's own) come from the schedule
    (``diloco/schedule.py``), which the caller reads.
    """
    numel = sum(g.numel() for g in theta_g)
    assert mean_delta.numel() == numel, f"Δ̄ has {mean_delta.numel()} values, θ_g {numel}"
    offset = 0
    for g in theta_g:
        g.grad = mean_delta[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
    if momentum is not None:
        for group in optimizer.param_groups:
            if "momentum" in group:
                group["momentum"] = momentum
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, local in zip(theta_g, theta_l, strict=True):
        new_global = g.to(local.device, non_blocking=True).to(local.dtype)
        local.copy_(alpha * local + (1 - alpha) * new_global if alpha > 0 else new_global)


@torch.no_grad()
def reset_local(theta_g: Sequence[torch.Tensor], theta_l: Sequence[torch.Tensor]) -> None:
    """θ_l ← θ_g, in θ_l's dtype and device, with no outer step.

    After a failed round (θ_g as it was), a closing round whose transfer failed, a heal,
    and at the end of the job (the model to evaluate and save is the global one).
    """
    for g, local in zip(theta_g, theta_l, strict=True):
        local.copy_(g.to(local.device).to(local.dtype))
