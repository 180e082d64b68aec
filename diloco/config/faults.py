"""``faults.*``: which faults a job injects, when, and against whom (diloco/launch/faults.py fires them)."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.config.base import check

WORKER_KINDS = ("break_lane", "nan")  # the planned kinds a worker injects itself, at its next round


@dataclass(frozen=True)
class FaultsConfig:
    """Seconds between faults of each kind (0: never), counted from ``start_after``."""

    seed: int = 0
    start_after: float = 20.0
    stop_after: float = 0.0  # no new faults after this many seconds (0: until the job ends)
    kill_every: float = 0.0
    kill_same_group_twice: bool = False  # False: a kill never hits the group killed just before
    min_alive: int = (
        0  # a kill never leaves fewer other groups holding the job's state: it goes elsewhere or is skipped
    )
    hang_every: float = 0.0
    hang_seconds: float = 5.0
    break_lane_every: float = 0.0
    nan_every: float = 0.0
    restart_lighthouse_every: float = 0.0
    lighthouse_down_seconds: float = 2.0
    accept_requests: bool = False  # workers take faults requested by hand too (LocalCluster.request_fault)
    # A straggler: group slow_group's workers sleep after each inner step, so every step takes
    # slowdown times as long as its compute (heterogeneous hardware; -1: no slow group).
    slow_group: int = -1
    slowdown: float = 1.0

    def validate(self) -> None:
        for key in ("start_after", "stop_after", "kill_every", "hang_every", "break_lane_every", "nan_every"):
            value = getattr(self, key)
            check(value >= 0, f"faults.{key}", value, "must be >= 0 seconds (0 turns it off)")
        check(
            self.restart_lighthouse_every >= 0,
            "faults.restart_lighthouse_every",
            self.restart_lighthouse_every,
            "must be >= 0",
        )
        check(
            not self.stop_after or self.stop_after > self.start_after,
            "faults.stop_after",
            self.stop_after,
            f"must be 0 (until the job ends) or > faults.start_after={self.start_after:g}: no fault could happen",
        )
        check(self.min_alive >= 0, "faults.min_alive", self.min_alive, "must be >= 0 (0: kills are never held back)")
        check(self.slow_group >= -1, "faults.slow_group", self.slow_group, "must be a group id, or -1 for none")
        check(
            self.slowdown >= 1,
            "faults.slowdown",
            self.slowdown,
            "must be >= 1 (2: every inner step takes twice as long)",
        )
        check(self.hang_seconds > 0, "faults.hang_seconds", self.hang_seconds, "must be > 0 seconds")
        check(
            self.lighthouse_down_seconds >= 0,
            "faults.lighthouse_down_seconds",
            self.lighthouse_down_seconds,
            "must be >= 0",
        )

    @property
    def in_workers(self) -> bool:
        """Whether workers watch for fault requests: the plan holds kinds they inject, or requests come by hand."""
        return self.accept_requests or any(self.period(kind) > 0 for kind in WORKER_KINDS)

    def period(self, kind: str) -> float:
        return getattr(self, f"{kind}_every")
