"""``algo.auto`` on one worker: measure, share the measurements through each round, re-plan.

Every group must use the same τ and payload format in a round, or their all-reduces would
not match. So the plan is part of the job's state, like θ_g: each round's all-reduce also
sums what every group measured (its inner step time and its link's seconds per byte, from
the round before), every group that commits the round gets the same sums and so computes
the same plan (``overlap_plan.choose_overlap``) for the rounds after it, and a group that
heals or resumes takes the plan with the state (``HealState.extra``, in the digest too).
Within a group, the leader's lane decides and its ranks follow (they must agree on τ too).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from diloco.config.algo import AlgoConfig
from diloco.ft.manager import Manager
from diloco.outer.codecs import codec_for
from diloco.outer.overlap_plan import OverlapPlan, choose_overlap
from diloco.outer.quantize import FORMATS

log = logging.getLogger(__name__)

N_MEASUREMENTS = 3  # what each group adds to a round's sum: [known, inner step s, link s per byte]


class AutoOverlap:
    """The current plan (a tensor of the job's state), its τ and codec, and this worker's measurements;
    a ``round_plan.RoundPlan``."""

    def __init__(self, algo: AlgoConfig, fragment_numel: int, device: torch.device | None = None) -> None:
        self.algo, self.device = algo, device
        self.plan = torch.tensor([algo.delay, FORMATS.index(algo.quantize)], dtype=torch.int64)
        self.delay, self.quantize, self.codec = algo.delay, algo.quantize, codec_for(algo, device)
        warmup = algo.sync_warmup_window()
        shortest = warmup[0] if warmup else algo.sync_every
        self.window_steps = shortest // algo.fragments  # τ < H/P in every window, the warm-up's too
        self.fragment_numel = fragment_numel  # the largest fragment of this worker's shard
        self.sparse = codec_for(algo) if algo.compress == "topk" else None  # a codec the plan does not pick
        self._step_times: list[float] = []
        self._step_began: float | None = None
        self._seconds_per_byte: float | None = None

    def step_begins(self) -> None:
        self._step_began = time.perf_counter()

    def step_ends(self) -> None:
        """An inner step ended; the time since ``step_begins`` was compute, not sync."""
        if self._step_began is not None:
            self._step_times.append(time.perf_counter() - self._step_began)
            self._step_began = None

    def transferred(self, seconds: float, nbytes: int) -> None:
        """A round's all-reduce sent ``nbytes`` from this worker in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self._seconds_per_byte = seconds / nbytes

    @property
    def seconds_per_byte(self) -> float | None:
        """This worker's last measured link (None before its first full round): in the commit
        records, so the plan can be checked against the link it was made for."""
        return self._seconds_per_byte

    def nothing_measured(self) -> torch.Tensor:
        """What a round joined after healing carries: every member adds as many values to the sum."""
        return torch.zeros(N_MEASUREMENTS)

    def measurements(self) -> torch.Tensor:
        """What this worker adds to the next round's sum (zeros until it has measured both); resets the step times."""
        steps, self._step_times = self._step_times, []
        if not steps or self._seconds_per_byte is None:
            return torch.zeros(N_MEASUREMENTS)
        return torch.tensor([1.0, sum(steps) / len(steps), self._seconds_per_byte])

    def decide(self, summed: torch.Tensor | None, groups: int) -> OverlapPlan | None:
        """The plan from a round's summed measurements; None if no group had measured yet."""
        if summed is None or float(summed[0]) <= 0:
            return None
        known = float(summed[0])
        return choose_overlap(
            fragment_numel=self.fragment_numel,
            groups=groups,
            window_steps=self.window_steps,
            step_s=float(summed[1]) / known,
            seconds_per_byte=float(summed[2]) / known,
            current=(int(self.plan[0]), FORMATS[int(self.plan[1])]),
            sparse=self.sparse,
        )

    def encode(self, plan: OverlapPlan | None) -> list[int]:
        """The plan as the leader shares it with its group: [τ, format index] (the current one if None)."""
        if plan is None:
            return [int(v) for v in self.plan]
        return [plan.delay, FORMATS.index(plan.quantize)]

    def adopt(self, encoded: list[int]) -> None:
        self.plan.copy_(torch.tensor(encoded, dtype=torch.int64))

    def follow(self) -> None:
        """Take up the plan tensor's τ and format (a plan out of range, from a peer or a file, is refused)."""
        delay, fmt = (int(v) for v in self.plan)
        if not (0 <= delay < self.window_steps and 0 <= fmt < len(FORMATS)):
            raise ValueError(f"algo.auto plan [delay={delay}, format={fmt}] out of range for H/P={self.window_steps}")
        self.delay, self.quantize = delay, FORMATS[fmt]
        self.codec = codec_for(dataclasses.replace(self.algo, delay=delay, quantize=self.quantize), self.device)

    def after_round(self, shared: torch.Tensor | None, groups: int, manager: Manager) -> None:
        """The plan from every group's summed measurements ``shared`` after a committed round.

        The leader decides from its lane's sums (the same in every group) and its group follows.
        """
        before = self.delay, self.quantize
        decided = self.decide(shared, groups) if manager.client is not None else None
        self.adopt(manager.from_leader(self.encode(decided)))
        self.follow()
        if (self.delay, self.quantize) != before:
            why = "" if decided is None else f": transfer {decided.transfer_s:.3f}s, hidden {decided.hidden_s:.3f}s"
            log.info(
                "group %s: algo.auto now delay=%d quantize=%s (was %d, %s)%s",
                manager.group,
                self.delay,
                self.quantize,
                *before,
                why,
            )

    def record_fields(self) -> dict[str, Any]:
        return {"delay": self.delay, "quantize": self.quantize, "link_s_per_byte": self.seconds_per_byte}
