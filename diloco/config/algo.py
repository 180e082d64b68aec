"""``algo.*``: which synchronization a job runs and its schedule, validated here and only here.

H (``sync_every``), P (``fragments``), τ (``delay``) and α (``alpha``) are checked together
against the model's blocks and the trainer's steps, each error naming the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.base import ConfigError, KeysRead, check
from diloco.schedule import SyncWarmup, WindowProblem, divisors, sync_warmup_window, window_problem

# Which algo.* keys each algorithm reads (x); a key it does not read does nothing there:
#
#   key                      ddp  local  diloco  streaming
#   sync_every (H)            .     .      x        x       ddp runs with 1 (a gradient all-reduce every step)
#   sync_warmup_steps,
#   sync_warmup_every         .     .      x        x
#   alpha, alpha_warmup_steps,
#   alpha_reference_groups    .     .      x        x
#   quantize                  .     .      x        x
#   compress, density,
#   value_bits, error_decay,
#   sparse_reference_groups   .     .      x        x
#   weighting, window,
#   diverged_rounds           .     .      x        x
#   fragments (P), pattern    .     .      .        x       diloco runs with 1 fragment
#   delay (τ), auto           .     .      .        x       diloco runs with no overlap
#
# A key an algorithm does not read, set to another value than the one it runs with (RUNS_WITH, else the
# default below; so a conf/algo preset's own values pass), is refused in a single run, and in a -m sweep
# (``algo=ddp,diloco algo.alpha=0.3``) said at start and reset (``KeysRead``, diloco/config/base.py).
_OUTER_KEYS = (
    "sync_every",
    "sync_warmup_steps",
    "sync_warmup_every",
    "alpha",
    "alpha_warmup_steps",
    "alpha_reference_groups",
    "quantize",
    "compress",
    "density",
    "value_bits",
    "error_decay",
    "sparse_reference_groups",
    "weighting",
    "window",
    "diverged_rounds",
)
SYNCING = ("diloco", "streaming")  # the algorithms with outer rounds (and so warm-ups and M-rules)
VALUE_BITS = (1, 2, 4, 8, 32)  # as diloco/outer/sparse.py offers them (config imports no runtime code)
READS: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "local": (),
    "diloco": _OUTER_KEYS,
    "streaming": (*_OUTER_KEYS, "fragments", "pattern", "delay", "auto"),
}
RUNS_WITH: dict[str, dict[str, object]] = {"ddp": {"sync_every": 1}}
_DOES = {
    "ddp": "all-reduces gradients every inner step and reads no other algo.* key",
    "local": "trains every group alone with no outer sync and reads no other algo.* key",
    "diloco": "syncs the whole model as one fragment with no overlap (algo.fragments=1, algo.delay=0)",
    "streaming": "reads every algo.* key",
}


@dataclass(frozen=True)
class AlgoConfig:
    """H inner steps per window, P fragments, overlap τ, mixing α, payload format (docs/algorithm.md).

    ``ddp`` all-reduces gradients across every worker of every group each step (the
    data-parallel baseline); ``local`` trains every group alone with no outer sync at all:
    the no-communication baseline that benchmarks measure the cost of syncing against.
    """

    name: Literal["diloco", "streaming", "ddp", "local"] = "diloco"
    sync_every: int = 50
    # Post-local SGD's warm-up (arXiv 1808.07217): the windows up to inner step ``sync_warmup_steps``
    # (W, rounded up to a whole H window; 0: none) are H₀ steps long, H₀ the shortest divisor of H
    # from ``sync_warmup_every`` up that the fragments and τ allow (``sync_warmup_window``). Trained
    # from scratch, the first rounds decide where a seed ends (docs/algorithm.md).
    sync_warmup_steps: int = 500
    sync_warmup_every: int = 10
    fragments: int = 1
    pattern: Literal["strided", "sequential"] = "strided"
    delay: int = 0
    # After each outer step a group keeps α of its own weights (0: DiLoCo's reset to θ_g). α
    # ramps linearly from 0 over the job's first ``alpha_warmup_steps`` inner steps (0: α from
    # the first round): early windows, whose pseudo-gradients are the largest, reset to the
    # global model; later ones keep half their own, which the 5,000-step runs need
    # (docs/notes/outer-recipe-defaults.md).
    # α is tuned for rounds of ``alpha_reference_groups`` groups (N); a round of M > N groups
    # averages a less noisy pseudo-gradient and keeps less of its own: α·(N/M)², which reaches
    # DiLoCo's reset, tuned with eight workers, as M grows (docs/notes/outer-recipe-defaults.md; 0: α whatever M).
    alpha: float = 0.5
    alpha_warmup_steps: int = 1000
    alpha_reference_groups: int = 2
    quantize: Literal["none", "bf16", "fp8", "int8", "fp4"] = "none"
    # SparseLoCo (arXiv 2508.15706, diloco/outer/sparse.py): send each 4096-entry chunk's top
    # ``density`` of β·e + Δ by magnitude, values in ``value_bits``, and keep the rest in the group's
    # error-feedback buffer e, decayed by β = ``error_decay`` each round (0: no feedback). density 1,
    # 32 bits and β 0 is plain DiLoCo. The paper pairs it with outer_opt=sgd (lr 1, no momentum: e is the momentum).
    compress: Literal["none", "topk"] = "none"
    density: float = 0.02
    value_bits: int = 2
    error_decay: float = 0.95
    # A kept entry is averaged over the groups that sent it, but over no fewer than N =
    # ``sparse_reference_groups`` (never more than the round's M): four groups' top 1% coincide
    # little, so M's plain mean shrinks each group's progress M-fold where SparseLoCo's outer lr 1
    # was tuned at N = 2 (docs/notes/sparseloco.md: at M = 4, 8.5% above DiLoCo H = 50 -> 5.4%).
    # Rounds of M <= N, and density 1 at any M, are the plain mean; 0: the plain mean always.
    sparse_reference_groups: int = 2
    weighting: Literal["uniform", "tokens"] = "uniform"
    # steps: every group runs H inner steps per window. time: a window lasts as long as the
    # fastest group takes for its steps; a group more than one inner step behind when the round
    # opens skips to it, having run fewer steps, and counts by the tokens it trained.
    window: Literal["steps", "time"] = "steps"
    # End the job after this many rounds in a row in which no group sent a finite Δ (NaN or inf in
    # every one: training diverged, and every round resets θ_l to the same θ_g), instead of training
    # the rest of max_steps for nothing; the job then fails, naming the divergence. 0: train on.
    diverged_rounds: int = 10
    # Re-pick τ (delay) and the payload format (quantize) after every round so each fragment's
    # all-reduce hides behind its overlap on the measured link (diloco/outer/overlap_plan.py); the
    # configured values are the first round's.
    auto: bool = False

    def validate(self) -> None:
        KEYS_READ.check(self)
        if self.window == "time":
            check(
                self.weighting == "tokens",
                "algo.weighting",
                self.weighting,
                "must be tokens with algo.window=time: a group that ran fewer inner steps must count for less",
            )
        self._validate_compress()
        check(
            _is_int(self.alpha_warmup_steps) and self.alpha_warmup_steps >= 0,
            "algo.alpha_warmup_steps",
            self.alpha_warmup_steps,
            "must be an integer >= 0 (0: α is algo.alpha from the first round)",
        )
        check(
            _is_int(self.sync_warmup_steps) and self.sync_warmup_steps >= 0,
            "algo.sync_warmup_steps",
            self.sync_warmup_steps,
            "must be an integer >= 0 (0: every window is algo.sync_every steps long from the first)",
        )
        check(
            _is_int(self.sync_warmup_every) and self.sync_warmup_every >= 1,
            "algo.sync_warmup_every",
            self.sync_warmup_every,
            "must be an integer >= 1 (the shortest warm-up window, in inner steps)",
        )
        check(
            _is_int(self.diverged_rounds) and self.diverged_rounds >= 0,
            "algo.diverged_rounds",
            self.diverged_rounds,
            "must be an integer >= 0 (0: a diverged job trains on to trainer.max_steps)",
        )
        check(
            _is_int(self.alpha_reference_groups) and self.alpha_reference_groups >= 0,
            "algo.alpha_reference_groups",
            self.alpha_reference_groups,
            "must be an integer >= 0 (0: α is algo.alpha whatever the number of groups in a round)",
        )

    def _validate_compress(self) -> None:
        check(self.compress in ("none", "topk"), "algo.compress", self.compress, "must be none or topk")
        check(
            _is_number(self.density) and 0 < self.density <= 1,
            "algo.density",
            self.density,
            "must be in (0, 1]: the fraction of each chunk of the pseudo-gradient sent (SparseLoCo: 0.01 to 0.03)",
        )
        check(
            _is_int(self.value_bits) and self.value_bits in VALUE_BITS,
            "algo.value_bits",
            self.value_bits,
            f"must be one of {', '.join(map(str, VALUE_BITS))} (bits per kept value; 32 sends them unquantized)",
        )
        check(
            _is_number(self.error_decay) and 0 <= self.error_decay <= 1,
            "algo.error_decay",
            self.error_decay,
            "must be in [0, 1] (β: e ← β·e + Δ before each round; 0 turns error feedback off)",
        )
        check(
            _is_int(self.sparse_reference_groups) and self.sparse_reference_groups >= 0,
            "algo.sparse_reference_groups",
            self.sparse_reference_groups,
            "must be an integer >= 0 (0: every kept entry is the plain mean over the round's groups)",
        )
        check(
            self.compress == "none" or self.quantize == "none",
            "algo.quantize",
            self.quantize,
            "cannot be combined with algo.compress=topk, which sets its own value precision: "
            "use algo.quantize=none with algo.value_bits",
        )

    def sync_warmup_window(self) -> SyncWarmup | None:
        """(H₀, W) of these keys (``diloco/schedule.py``); None for an algorithm without outer rounds."""
        if self.name not in ("diloco", "streaming"):
            return None
        return sync_warmup_window(
            self.sync_every, self.fragments, self.delay, self.sync_warmup_every, self.sync_warmup_steps
        )

    def check_fits(self, *, n_blocks: int) -> None:
        """The check that needs the model: P fragments of whole transformer blocks."""
        validate_schedule(
            sync_every=self.sync_every, fragments=self.fragments, delay=self.delay, alpha=self.alpha, n_blocks=n_blocks
        )


KEYS_READ = KeysRead("algo", AlgoConfig, READS, _DOES, RUNS_WITH)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_schedule(*, sync_every: int, fragments: int, delay: int, alpha: float, n_blocks: int) -> None:
    """Raise ``ConfigError`` naming the ``algo.*`` key whose value breaks the schedule, and the fix."""
    H, P, tau = sync_every, fragments, delay
    problem = window_problem(H, P, tau)
    check(
        _is_int(H) and problem is not WindowProblem.H_BELOW_ONE,
        "algo.sync_every",
        H,
        "must be an integer >= 1 (inner steps per outer window H)",
    )
    check(
        _is_int(P) and problem is not WindowProblem.P_BELOW_ONE,
        "algo.fragments",
        P,
        "must be an integer >= 1 (1 is plain DiLoCo)",
    )
    check(
        P <= n_blocks,
        "algo.fragments",
        P,
        f"is larger than the model's {n_blocks} transformer blocks (model.n_layers); every fragment needs "
        f"at least one block, so pick fragments <= {n_blocks}",
    )
    if problem is WindowProblem.P_NOT_DIVIDING_H:
        choices = [d for d in divisors(H) if d <= n_blocks]
        limit = f" (the divisors of {H} up to model.n_layers={n_blocks})" if max(divisors(H)) > n_blocks else ""
        raise ConfigError(
            f"algo.sync_every={H} is not divisible by algo.fragments={P}; pick fragments in "
            f"{{{', '.join(map(str, choices))}}}{limit} or change algo.sync_every"
        )
    check(
        _is_int(tau) and problem is not WindowProblem.TAU_NEGATIVE,
        "algo.delay",
        tau,
        "must be an integer >= 0 (0: apply right after launch)",
    )
    check(
        problem is not WindowProblem.TAU_NOT_BELOW_SPACING,
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
