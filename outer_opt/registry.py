"""The outer-optimizer registry: a name in the config maps to a function that builds one.

The outer optimizer steps the global parameters θ_g with the averaged pseudo-gradient
Δ̄ = mean over groups of (θ_g − θ_l) as their ``.grad`` (DiLoCo, arXiv 2311.08105, Alg. 1).
A builder registered here must return an optimizer whose per-parameter state already holds
every entry that a step would create (see ``initialize_state``): then a freshly built
optimizer and one that has stepped expose the same state tensor names, which is what lets a
healing group receive the state as raw tensors and check it by digest (``outer_opt.state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from outer_opt.config import OuterOptConfig

Params = list[torch.Tensor]
Builder = Callable[[Params, "OuterOptConfig"], torch.optim.Optimizer]

_REGISTRY: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder(params, cfg) -> Optimizer`` available as ``outer_opt.name=<name>``.

    The builder must create all per-parameter state eagerly with ``initialize_state`` (an
    optimizer without state, like SGD without momentum, needs nothing).
    """
    if not name or not name.isidentifier() or name != name.lower():
        raise ValueError(f"outer optimizer name {name!r} must be a lowercase identifier")

    def decorate(builder: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"outer optimizer {name!r} is already registered (by {_REGISTRY[name].__qualname__})")
        _REGISTRY[name] = builder
        return builder

    return decorate


def available() -> list[str]:
    """Registered names, sorted."""
    return sorted(_REGISTRY)


def build_outer_optimizer(
    params: list[torch.Tensor | torch.nn.Parameter], cfg: OuterOptConfig
) -> torch.optim.Optimizer:
    """The outer optimizer ``cfg.name`` over θ_g, with its state already initialised.

    ``params`` are the global parameters θ_g: leaf fp32 tensors, plain or ``nn.Parameter``
    (``requires_grad`` is not needed), that the optimizer updates in place. Before each
    ``step()`` the caller sets every ``p.grad`` to Δ̄ for that parameter. Their order fixes
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
    opt = _REGISTRY[cfg.name](params, cfg)
    built = [p for group in opt.param_groups for p in group["params"]]
    if len(built) != len(params) or any(a is not b for a, b in zip(built, params)):
        raise ValueError(
            f"outer optimizer builder {cfg.name!r} must optimize exactly the given {len(params)} params, "
            f"in order (it holds {len(built)})"
        )
    return opt


def initialize_state(
    opt: torch.optim.Optimizer, make: Callable[[torch.Tensor, dict[str, Any]], dict[str, Any]]
) -> torch.optim.Optimizer:
    """Set ``opt.state[p] = make(p, param_group)`` for every parameter; returns ``opt``.

    ``make`` must produce exactly what the optimizer's own lazy initialisation would (the
    same keys, values, dtypes and devices), so the first step behaves as if nothing had
    happened; torch.optim and torch-optimizer skip their initialisation when the state of
    a parameter is not empty.
    """
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = make(p, group)
    return opt
