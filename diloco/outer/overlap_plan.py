"""``algo.auto``: the overlap τ and payload format that hide each fragment's all-reduce on the measured link.

Pure functions of plain numbers. Streaming DiLoCo (arXiv 2501.18512) hides a fragment's
all-reduce behind the τ inner steps after its launch and shrinks it with low-bit outer
gradients; both cost little quality, but neither is free: a larger τ applies staler updates,
fewer bits round them. So the plan takes the smallest τ at which some format's transfer
fits in τ inner steps, and at that τ the most precise format that fits. A transfer "fits"
when what it leaves unhidden is at most ``STALL_SLACK`` of the fragment's window, so a fast
link keeps τ = 0 and full precision. When nothing fits (a link too slow even for 4 bits
within the window), the plan that stalls least: the largest τ, 4 bits. With ``algo.compress=topk``
the payload is the sparse codec's, whose precision the job fixes: the plan picks τ alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.outer.codecs import Codec, format_codec

FORMATS_BY_PRECISION = ("none", "bf16", "fp8", "fp4")
STALL_SLACK = 0.02  # of a fragment's window (H/P inner steps): a stall this short counts as hidden
HYSTERESIS = 0.2  # a fitting plan gives way to a better one only if that one fits with this margin


@dataclass(frozen=True)
class OverlapPlan:
    """τ and the payload format, with the transfer time and the hidden time the choice was made from."""

    delay: int
    quantize: str
    transfer_s: float
    hidden_s: float

    @property
    def stall_s(self) -> float:
        return max(0.0, self.transfer_s - self.hidden_s)


def choose_overlap(
    *,
    fragment_numel: int,
    groups: int,
    window_steps: int,
    step_s: float,
    seconds_per_byte: float,
    current: tuple[int, str] | None = None,
    sparse: Codec | None = None,
) -> OverlapPlan:
    """The plan for fragments of ``fragment_numel`` values reduced over ``groups`` groups every
    ``window_steps`` (H/P) inner steps of ``step_s``, on a link that carries a byte in ``seconds_per_byte``.

    ``current`` (τ, format) is kept while it still fits and the better plan fits by less than
    ``HYSTERESIS``: measurements on a busy machine jitter, and the plan should not follow them.
    ``sparse``: the job's topk codec (``codecs.Sparse``); the format stays none (its values are its business).
    """
    if fragment_numel < 1 or groups < 1 or window_steps < 1 or step_s < 0 or seconds_per_byte < 0:
        raise ValueError(
            f"need positive sizes and non-negative times, got numel={fragment_numel}, groups={groups}, "
            f"window_steps={window_steps}, step_s={step_s}, seconds_per_byte={seconds_per_byte}"
        )
    slack = STALL_SLACK * window_steps * step_s

    def plan(delay: int, fmt: str) -> OverlapPlan:
        codec = sparse if sparse is not None else format_codec(fmt)
        seconds = codec.bytes_sent(fragment_numel, groups) * seconds_per_byte
        return OverlapPlan(delay, fmt, seconds, delay * step_s)

    def fits(p: OverlapPlan, margin: float = 0.0) -> bool:
        return p.transfer_s <= (p.hidden_s + slack) * (1 - margin)

    formats = ("none",) if sparse is not None else FORMATS_BY_PRECISION
    order = [(d, f) for d in range(window_steps) for f in formats]
    best = next((plan(*key) for key in order if fits(plan(*key))), plan(window_steps - 1, formats[-1]))
    if current in order and current != (best.delay, best.quantize):
        kept = plan(*current)
        if fits(kept) and not fits(best, HYSTERESIS):
            return kept
    return best
