"""Fault-tolerant DiLoCo: replica groups that train one model while talking to each other rarely.

``from diloco import DiLoCo`` wraps a training loop of one's own (docs/library.md); the names are
loaded on first use, so ``run.py``'s roles and the launcher import none of the outer stack for it.
"""

from typing import Any

__all__ = ["AlgoConfig", "DiLoCo", "OuterOptConfig", "OuterResult", "TimeoutsConfig", "init_group", "refuse"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from diloco import library

        return getattr(library, name)
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
