"""``algo.*``: which synchronization a job runs and its schedule, validated here and only here.

H (``sync_every``), P (``fragments``), τ (``delay``) and α (``alpha``) are checked together
against the model's blocks and the trainer's steps, each error naming the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.base import ConfigError, check


@dataclass(frozen=True)
class AlgoConfig:
    """H inner steps per window, P fragments, overlap τ, mixing α, payload format (DESIGN section 2).

    ``ddp`` all-reduces gradients across every worker of every group each step (the
    data-parallel baseline); ``local`` trains every group alone with no outer sync at all:
    the no-communication baseline that benchmarks measure the cost of syncing against.
    """

    name: Literal["diloco", "streaming", "ddp", "local"] = "diloco"
    sync_every: int = 50
    fragments: int = 1
    pattern: Literal["strided", "sequential"] = "strided"
    delay: int = 0
    # After each outer step a group keeps α of its own weights (0: DiLoCo's reset to θ_g). α
    # ramps linearly from 0 over the job's first ``alpha_warmup_steps`` inner steps (0: α from
    # the first round): early windows, whose pseudo-gradients are the largest, reset to the
    # global model; later ones keep half their own, which the 5,000-step runs need (docs/results.md).
    # α is tuned for rounds of ``alpha_reference_groups`` groups (N); a round of M > N groups
    # averages a less noisy pseudo-gradient and keeps less of its own: α·(N/M)², which reaches
    # DiLoCo's reset, tuned with eight workers, as M grows (docs/results.md; 0: α whatever M).
    alpha: float = 0.5
    alpha_warmup_steps: int = 1000
    alpha_reference_groups: int = 2
    quantize: Literal["none", "bf16", "fp8", "int8", "fp4"] = "none"
    weighting: Literal["uniform", "tokens"] = "uniform"
    # steps: every group runs H inner steps per window. time: a window lasts as long as the
    # fastest group takes for its steps; a group more than one inner step behind when the round
    # opens skips to it, having run fewer steps, and counts by the tokens it trained.
    window: Literal["steps", "time"] = "steps"
    # Re-pick τ (delay) and the payload format (quantize) after every round so each fragment's
    # all-reduce hides behind its overlap on the measured link (diloco/outer/overlap_plan.py); the
    # configured values are the first round's.
    auto: bool = False

    def validate(self) -> None:
        if self.window == "time":
            check(
                self.name in ("diloco", "streaming"),
                "algo.window",
                self.window,
                f"time-bounded windows need outer rounds; algo={self.name} has none, so use algo.window=steps",
            )
            check(
                self.weighting == "tokens",
                "algo.weighting",
                self.weighting,
                "must be tokens with algo.window=time: a group that ran fewer inner steps must count for less",
            )
        check(
            not self.auto or self.name == "streaming",
            "algo.auto",
            self.auto,
            f"picks Streaming DiLoCo's overlap (algo.delay) and payload format; algo={self.name} has no overlap, "
            "so use algo=streaming or algo.auto=false",
        )
        check(
            _is_int(self.alpha_warmup_steps) and self.alpha_warmup_steps >= 0,
            "algo.alpha_warmup_steps",
            self.alpha_warmup_steps,
            "must be an integer >= 0 (0: α is algo.alpha from the first round)",
        )
        check(
            _is_int(self.alpha_reference_groups) and self.alpha_reference_groups >= 0,
            "algo.alpha_reference_groups",
            self.alpha_reference_groups,
            "must be an integer >= 0 (0: α is algo.alpha whatever the number of groups in a round)",
        )
        if self.name == "diloco":
            check(
                self.fragments == 1, "algo.fragments", self.fragments, "must be 1 for algo=diloco; use algo=streaming"
            )
            check(self.delay == 0, "algo.delay", self.delay, "must be 0 for algo=diloco; use algo=streaming")

    def mixing_alpha(self, launch_step: int, groups: int) -> float:
        """α for the round of ``groups`` groups launched after inner step ``launch_step``.

        Both are the same on every group of a round, so every group mixes alike and no state is kept.
        """
        alpha = self.alpha
        if self.alpha_reference_groups:
            alpha *= min(1.0, (self.alpha_reference_groups / groups) ** 2)
        if self.alpha_warmup_steps:
            alpha *= min(1.0, max(launch_step, 1) / self.alpha_warmup_steps)
        return alpha

    def check_fits(self, *, n_blocks: int, max_steps: int) -> None:
        """The checks that need the model and the trainer: fragments per block, whole windows."""
        validate_schedule(
            sync_every=self.sync_every, fragments=self.fragments, delay=self.delay, alpha=self.alpha, n_blocks=n_blocks
        )
        check(
            self.name == "local" or max_steps % self.sync_every == 0,
            "trainer.max_steps",
            max_steps,
            f"is not a multiple of algo.sync_every={self.sync_every}; the inner steps after the last "
            "sync would never reach the global model, so round max_steps to a multiple of sync_every",
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_schedule(*, sync_every: int, fragments: int, delay: int, alpha: float, n_blocks: int) -> None:
    """Raise ``ConfigError`` naming the ``algo.*`` key whose value breaks the schedule, and the fix."""
    H, P, tau = sync_every, fragments, delay
    check(_is_int(H) and H >= 1, "algo.sync_every", H, "must be an integer >= 1 (inner steps per outer window H)")
    check(_is_int(P) and P >= 1, "algo.fragments", P, "must be an integer >= 1 (1 is plain DiLoCo)")
    check(
        P <= n_blocks,
        "algo.fragments",
        P,
        f"is larger than the model's {n_blocks} transformer blocks (model.n_layers); every fragment needs "
        f"at least one block, so pick fragments <= {n_blocks}",
    )
    if H % P != 0:
        choices = [d for d in _divisors(H) if d <= n_blocks]
        limit = f" (the divisors of {H} up to model.n_layers={n_blocks})" if max(_divisors(H)) > n_blocks else ""
        raise ConfigError(
            f"algo.sync_every={H} is not divisible by algo.fragments={P}; pick fragments in "
            f"{{{', '.join(map(str, choices))}}}{limit} or change algo.sync_every"
        )
    check(_is_int(tau) and tau >= 0, "algo.delay", tau, "must be an integer >= 0 (0: apply right after launch)")
    check(
        tau < H // P,
        "algo.delay",
        tau,
        f"must be < algo.sync_every / algo.fragments = {H // P}, so each fragment's all-reduce is applied "
        "before the next fragment's is launched; lower algo.delay or use fewer fragments",
    )
    check(
        isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 <= alpha <= 1,
        "algo.alpha",
        alpha,
        "must be in [0, 1] (θ_l ← α·θ_l + (1−α)·θ_g after a fragment's outer step; 0 is DiLoCo's reset)",
    )
