"""The round's plan: the overlap τ and the payload codec ``OuterSync`` uses in its next rounds.

``FixedPlan`` is the job's config, for a job without ``algo.auto``; ``auto_overlap.AutoOverlap``
measures and re-plans after every committed round. ``OuterSync`` calls either the same way.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from diloco.config.algo import AlgoConfig
from diloco.ft.manager import Manager
from diloco.outer.codecs import Codec, codec_for


class RoundPlan(Protocol):
    """τ and the codec of the next rounds, and the hooks through which a plan may change them."""

    delay: int
    codec: Codec

    def step_begins(self) -> None:
        """An inner step begins."""

    def step_ends(self) -> None:
        """An inner step ended."""

    def measurements(self) -> torch.Tensor | None:
        """What this worker adds to the sum of the round it launches (None: nothing)."""

    def nothing_measured(self) -> torch.Tensor | None:
        """What it adds to a round it joins after healing."""

    def transferred(self, seconds: float, nbytes: int) -> None:
        """A round's reduce sent ``nbytes`` from this worker in ``seconds``."""

    def follow(self) -> None:
        """Take up the plan held in the state (a peer's after a heal, a checkpoint's after a resume)."""

    def after_round(self, shared: torch.Tensor | None, groups: int, manager: Manager) -> None:
        """After a committed round of ``groups`` groups whose members' measurements summed to ``shared``."""

    def record_fields(self) -> dict[str, Any]:
        """What the commit records say of the plan."""


class FixedPlan:
    """The configured τ and codec, for every round."""

    def __init__(self, algo: AlgoConfig, device: torch.device | None = None) -> None:
        self.delay = algo.delay
        self.codec = codec_for(algo, device)

    def step_begins(self) -> None:
        pass

    def step_ends(self) -> None:
        pass

    def measurements(self) -> None:
        return None

    def nothing_measured(self) -> None:
        return None

    def transferred(self, seconds: float, nbytes: int) -> None:
        pass

    def follow(self) -> None:
        pass

    def after_round(self, shared: torch.Tensor | None, groups: int, manager: Manager) -> None:
        pass

    def record_fields(self) -> dict[str, Any]:
        return {}
