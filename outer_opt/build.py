"""Build the outer optimizer a job's ``outer_opt.*`` names, over θ_g, with its state initialised."""

from __future__ import annotations

import torch

from outer_opt.config import OuterOptConfig
from outer_opt.registry import registered


def build_outer_optimizer(
    params: list[torch.Tensor | torch.nn.Parameter], cfg: OuterOptConfig
) -> torch.optim.Optimizer:
    """The outer optimizer ``cfg.name`` over θ_g, with its state already initialised.

    ``params`` are the global parameters θ_g: leaf fp32 tensors, plain or ``nn.Parameter``
    (``requires_grad`` is not needed), that the optimizer updates in place. Before each
    ``step()`` the caller sets every ``p.grad`` to Δ̄ for that parameter, which the step may
    overwrite (the built-in SGDs use it as their scratch: ``optimizers.InPlaceSGD``). The params' order fixes
    the state names ``p{index}.…`` (see ``optimizer_state_tensors``), so every group must pass
    the same parameters in the same order.
    """
    cfg.validate()
    params = list(params)
    if not params:
        raise ValueError("the outer optimizer needs at least one parameter")
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"outer optimizer param {i} is a {type(p).__name__}, expected a tensor")
        if p.dtype != torch.float32:
            raise ValueError(
                f"outer optimizer param {i} has dtype {p.dtype}; θ_g must be fp32 so that small outer "
                "updates are not lost to rounding"
            )
        if not p.is_leaf:
            raise ValueError(f"outer optimizer param {i} is not a leaf tensor; pass a detached copy of θ_g")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("outer optimizer params contain the same tensor twice")
    opt = registered(cfg.name)(params, cfg)
    built = [p for group in opt.param_groups for p in group["params"]]
    if len(built) != len(params) or any(a is not b for a, b in zip(built, params)):
        raise ValueError(
            f"outer optimizer builder {cfg.name!r} must optimize exactly the given {len(params)} params, "
            f"in order (it holds {len(built)})"
        )
    return opt
