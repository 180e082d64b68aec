"""Fault-tolerant DiLoCo as a library: the outer machinery around a training loop of one's own
(``DiLoCo``; ``init_group`` joins a group's workers under torchrun), built from the same parts a job's workers build (``build``). docs/library.md."""

from diloco.config.algo import AlgoConfig
from diloco.config.cluster import TimeoutsConfig
from diloco.library.build import Membership, OuterSettings, build_outer_sync
from diloco.library.group import init_group, refuse
from diloco.library.loop import DiLoCo, OuterResult
from outer_opt import OuterOptConfig

__all__ = [
    "AlgoConfig",
    "DiLoCo",
    "Membership",
    "OuterOptConfig",
    "OuterResult",
    "OuterSettings",
    "TimeoutsConfig",
    "build_outer_sync",
    "init_group",
    "refuse",
]
