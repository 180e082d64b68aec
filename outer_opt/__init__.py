"""Outer optimizers for DiLoCo: built by name from ``OuterOptConfig`` through a small registry.

The outer optimizer steps the global parameters θ_g with the averaged pseudo-gradient Δ̄ as
their gradient. ``import outer_opt`` registers the built-ins (``available()`` lists them);
``register`` adds more.
"""

from outer_opt import optimizers as _builtins  # noqa: F401  (registers the built-in optimizers)
from outer_opt.build import build_outer_optimizer
from outer_opt.config import OuterOptConfig
from outer_opt.registry import available, initialize_state, register
from outer_opt.state import load_optimizer_state_tensors, optimizer_state_tensors

__all__ = [
    "OuterOptConfig",
    "available",
    "build_outer_optimizer",
    "initialize_state",
    "load_optimizer_state_tensors",
    "optimizer_state_tensors",
    "register",
]
