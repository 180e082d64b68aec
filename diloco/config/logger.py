"""``logger.*``: where metrics go besides metrics.jsonl (wandb, offline by default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.base import check


@dataclass(frozen=True)
class LoggerConfig:
    """wandb settings; ``offline`` needs no account and no network (``wandb sync`` uploads later)."""

    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "diloco"
    entity: str | None = None
    name: str | None = None  # the runs' name before "-group<g>" (default: the job's name)
    group: str | None = None  # the wandb group of the job's runs (default: the job's name)

    def validate(self) -> None:
        check(bool(self.project), "logger.project", self.project, "must be a non-empty string")
