"""The outer all-reduce of one fragment's pseudo-gradient over a lane, optionally quantized.

``none`` sums fp32 ``w·Δ`` with a Gloo all-reduce. Quantized formats all-gather every
group's packed ``w·Δ`` (Gloo has no reduction for packed bytes) and each worker dequantizes
and sums in fp32 in rank order, so every group gets the same bits. The weight w (1, or the
tokens a group processed; 0 for a group that only heals) rides along, so the average is
over the groups that contributed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diloco.quantize import quantize, reduce_quantized

WEIGHT_BYTES = 4


@dataclass
class PendingReduce:
    """An all-reduce in flight; ``result`` waits (bounded by the caller) and averages."""

    work: dist.Work
    finish: Callable[[], torch.Tensor | None]
    bytes_sent: int

    def result(self, wait: Callable[[dist.Work], None]) -> torch.Tensor | None:
        """The weighted mean Δ̄ over contributing groups, or None if nobody contributed."""
        wait(self.work)
        return self.finish()


def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    """Bytes one member sends in a ring all-reduce: reduce-scatter plus all-gather."""
    return 2 * (size - 1) * nbytes // size


def launch_reduce(lane: dist.ProcessGroup, delta: torch.Tensor, weight: float, fmt: str, size: int) -> PendingReduce:
    """Start summing ``weight * delta`` and ``weight`` over the lane, without waiting."""
    if fmt == "none":
        buffer = torch.cat([delta * weight, torch.tensor([weight], dtype=torch.float32)])
        work = lane.allreduce([buffer])
        return PendingReduce(
            work, lambda: _mean(buffer[:-1], float(buffer[-1])), ring_allreduce_bytes(buffer.nbytes, size)
        )
    payload = quantize(delta * weight, fmt)
    packed = torch.cat([payload, torch.tensor([weight], dtype=torch.float32).view(torch.uint8)])
    gathered = [torch.empty_like(packed) for _ in range(size)]
    work = lane.allgather([gathered], [packed])

    def finish() -> torch.Tensor | None:
        total = sum(float(g[-WEIGHT_BYTES:].view(torch.float32)) for g in gathered)
        summed = reduce_quantized([g[:-WEIGHT_BYTES] for g in gathered], fmt, delta.numel())
        return _mean(summed, total)

    return PendingReduce(work, finish, (size - 1) * packed.nbytes)


def _mean(summed: torch.Tensor, total_weight: float) -> torch.Tensor | None:
    if total_weight <= 0:
        return None
    return summed / total_weight
