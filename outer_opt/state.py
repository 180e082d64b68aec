"""Outer-optimizer state as named raw tensors: how it travels to a healing group and gets digested.

``optimizer_state_tensors`` flattens every parameter's state to ``"p{index}.{key}"`` →
tensor, where ``index`` counts parameters across param groups in order; Python scalars in the
state (torch-optimizer's integer ``step``, AdaBelief's ``rho_inf``) become 0-d int64 / float64
/ bool tensors, which hold them exactly. No pickle is involved (docs/design.md, invariant 5).
``load_optimizer_state_tensors`` writes such a dict into an optimizer built the same way, so
its next step is bit-identical to the original's.
"""

from __future__ import annotations

import torch
import torch_optimizer

# State entries an optimizer rewrites on every step without reading them: not state that
# needs to travel, and their type varies (Lamb stores trust_ratio as int 1 or a tensor).
_TRANSIENT: dict[type, frozenset[str]] = {
    torch_optimizer.Lamb: frozenset({"weight_norm", "adam_norm", "trust_ratio"}),
}

_SCALAR_DTYPES: dict[type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float64}


def _transient_keys(opt: torch.optim.Optimizer) -> frozenset[str]:
    return frozenset().union(*(keys for cls, keys in _TRANSIENT.items() if isinstance(opt, cls)))


def _named_state(opt: torch.optim.Optimizer) -> dict[str, tuple[dict, str]]:
    """name → (the state dict holding it, its key), in parameter and insertion order."""
    skip = _transient_keys(opt)
    named: dict[str, tuple[dict, str]] = {}
    params = [p for group in opt.param_groups for p in group["params"]]
    for index, p in enumerate(params):
        state = opt.state.get(p, {})
        for key in state:
            if key not in skip:
                named[f"p{index}.{key}"] = (state, key)
    return named


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The per-parameter state of ``opt`` as named tensors.

    Tensor state is returned by reference (detached, not copied: a later step changes it;
    clone for a snapshot); Python scalars become new 0-d tensors. Raises ``TypeError`` on
    state that cannot be a tensor (lists, dicts, None).
    """
    out: dict[str, torch.Tensor] = {}
    for name, (state, key) in _named_state(opt).items():
        value = state[key]
        if isinstance(value, torch.Tensor):
            out[name] = value.detach()
        elif type(value) in _SCALAR_DTYPES:
            out[name] = torch.tensor(value, dtype=_SCALAR_DTYPES[type(value)])
        else:
            raise TypeError(f"optimizer state {name} is a {type(value).__name__}; it cannot travel as a tensor")
    return out


@torch.no_grad()
def load_optimizer_state_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite the state of ``opt`` with ``tensors`` from ``optimizer_state_tensors``.

    ``opt`` must already hold the same names (``build_outer_optimizer`` creates the state
    eagerly); each tensor must match the existing entry's shape and dtype, and scalars the
    exact dtype they were flattened to. Existing state tensors are written in place, so
    nothing of ``tensors`` is kept by reference.
    """
    named = _named_state(opt)
    missing = [n for n in named if n not in tensors]
    unexpected = [n for n in tensors if n not in named]
    if missing or unexpected:
        raise ValueError(
            f"optimizer state names differ: missing {missing[:5]}{'…' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}; were both optimizers built "
            "with the same outer_opt config over the same parameters?"
        )
    updates: list[tuple[dict, str, object]] = []
    for name, (state, key) in named.items():
        current, incoming = state[key], tensors[name]
        if not isinstance(incoming, torch.Tensor):
            raise TypeError(f"optimizer state {name} must be a tensor, got {type(incoming).__name__}")
        if isinstance(current, torch.Tensor):
            if incoming.shape != current.shape or incoming.dtype != current.dtype:
                raise ValueError(
                    f"optimizer state {name}: got {incoming.dtype} {tuple(incoming.shape)}, "
                    f"expected {current.dtype} {tuple(current.shape)}"
                )
            updates.append((state, key, incoming))
        elif type(current) in _SCALAR_DTYPES:
            want = _SCALAR_DTYPES[type(current)]
            if incoming.dim() != 0 or incoming.dtype != want:
                raise ValueError(
                    f"optimizer state {name}: got {incoming.dtype} {tuple(incoming.shape)}, expected a 0-d {want} "
                    f"holding a Python {type(current).__name__}"
                )
            updates.append((state, key, type(current)(incoming.item())))
        else:
            raise TypeError(f"optimizer state {name} is a {type(current).__name__}; it cannot be loaded from a tensor")
    # Validate everything before writing anything, so a bad dict leaves ``opt`` untouched.
    for state, key, value in updates:
        if isinstance(value, torch.Tensor):
            state[key].copy_(value)
        else:
            state[key] = value
