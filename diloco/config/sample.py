"""``sample.*``: what ``role=sample`` generates from a trained model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.config.base import check


@dataclass(frozen=True)
class SampleConfig:
    """What ``role=sample`` generates: ``max_new_tokens`` after ``prompt``, drawn at ``temperature``
    from the ``top_k`` likeliest tokens (temperature 0: always the likeliest; top_k 0: all)."""

    prompt: str = "def"
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0

    def validate(self) -> None:
        check(len(self.prompt) > 0, "sample.prompt", self.prompt, "must not be empty: the model continues it")
        check(self.max_new_tokens >= 1, "sample.max_new_tokens", self.max_new_tokens, "must be at least 1")
        check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "sample.temperature",
            self.temperature,
            "must be >= 0 (0: always the likeliest token)",
        )
        check(self.top_k >= 0, "sample.top_k", self.top_k, "must be >= 0 (0: sample from every token)")
