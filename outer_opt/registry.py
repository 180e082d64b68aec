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
from typing import Any

import torch

Params = list[torch.Tensor]
# builder(params, cfg: OuterOptConfig): the config is not named here, so that outer_opt.config,
# which checks outer_opt.name against ``available()``, and this module import each other in no circle.
Builder = Callable[[Params, Any], torch.optim.Optimizer]

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


def registered(name: str) -> Builder:
    """The builder registered as ``name`` (``OuterOptConfig.validate`` has checked it exists)."""
    return _REGISTRY[name]


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
