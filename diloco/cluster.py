"""Where a job runs: how many replica groups, how many workers each, on which device, with which timeouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from diloco.config_base import check


@dataclass(frozen=True)
class TimeoutsConfig:
    """Seconds; every wait in the system is bounded by one of these."""

    connect: float = 60.0
    collective: float = 120.0

    def validate(self) -> None:
        for key in ("connect", "collective"):
            value = getattr(self, key)
            check(value > 0, f"cluster.timeouts.{key}", value, "must be > 0 seconds")


@dataclass(frozen=True)
class ClusterConfig:
    """M replica groups of N workers; ``master_addr`` is where a group's workers rendezvous."""

    groups: int = 1
    workers_per_group: int = 2
    device: Literal["auto", "cpu", "cuda"] = "auto"
    master_addr: str = "127.0.0.1"
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)

    def validate(self) -> None:
        check(self.groups >= 1, "cluster.groups", self.groups, "must be a positive integer")
        check(
            self.workers_per_group >= 1,
            "cluster.workers_per_group",
            self.workers_per_group,
            "must be a positive integer",
        )
        self.timeouts.validate()
