"""The outer all-reduce of one fragment's pseudo-gradient over a lane, optionally quantized.

``none`` sums fp32 ``w·Δ`` with a Gloo all-reduce. Quantized formats all-gather every
group's packed ``w·Δ`` (Gloo has no reduction for packed bytes) and each worker dequantizes
and sums in fp32 in rank order, so every group gets the same bits. The weight w (1, or the
tokens a group processed; 0 for a group that only heals) rides along, so the average is
over the groups that contributed, and so may a few extra numbers each member adds to the
sum (``algo.auto``'s measurements).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diloco.outer.bandwidth import TokenBucket
from diloco.outer.quantize import packed_nbytes, quantize, reduce_quantized
from diloco.outer.update import weighted_mean


@dataclass
class PendingReduce:
    """An all-reduce in flight; ``result`` waits (bounded by the caller) and averages.

    ``extras``: the sum over the lane of every member's extra numbers (``launch_reduce``),
    the same bits on every member, set once ``result`` returned.
    """

    work: dist.Work
    finish: Callable[[], tuple[torch.Tensor | None, torch.Tensor]]
    bytes_sent: int
    ready_at: float = 0.0  # with a bandwidth limit: when the link has carried bytes_sent
    bucket: TokenBucket | None = None
    extras: torch.Tensor | None = None

    def result(self, wait: Callable[[dist.Work], None]) -> torch.Tensor | None:
        """The weighted mean Δ̄ over contributing groups, or None if nobody contributed."""
        wait(self.work)
        if self.bucket is not None:
            self.bucket.wait_until(self.ready_at)
        mean, self.extras = self.finish()
        return mean


def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    """Bytes one member sends in a ring all-reduce: reduce-scatter plus all-gather."""
    return 2 * (size - 1) * nbytes // size


def bytes_sent_for(numel: int, fmt: str, size: int, n_extras: int = 0) -> int:
    """Bytes one member sends to reduce ``numel`` values in ``fmt`` over ``size`` members, as ``launch_reduce`` does."""
    tail = 4 * (1 + n_extras)  # the weight and the extras, float32
    if fmt == "none":
        return ring_allreduce_bytes(4 * numel + tail, size)
    return (size - 1) * (packed_nbytes(numel, fmt) + tail)


def launch_reduce(
    lane: dist.ProcessGroup,
    delta: torch.Tensor,
    weight: float,
    fmt: str,
    size: int,
    extras: torch.Tensor | None = None,
    bucket: TokenBucket | None = None,
    codec_device: torch.device | None = None,
) -> PendingReduce:
    """Start summing ``weight * delta``, ``weight`` and the float32 ``extras`` over the lane, without waiting.

    With a ``bucket`` the result is held back until the link has carried the bytes this member sends.
    ``codec_device``: where a quantized format is encoded and decoded (a worker's GPU: a 150M Δ
    takes seconds on the CPU). Every step is elementwise IEEE arithmetic, so the bits equal the
    CPU's and groups on different devices still agree.
    """
    extras = torch.zeros(0, dtype=torch.float32) if extras is None else extras.to(torch.float32)
    if fmt == "none":
        n = delta.numel()
        buffer = torch.cat([delta * weight, torch.tensor([weight], dtype=torch.float32), extras])
        work = lane.allreduce([buffer])
        pending = PendingReduce(
            work,
            lambda: (weighted_mean(buffer[:n], float(buffer[n])), buffer[n + 1 :]),
            ring_allreduce_bytes(buffer.nbytes, size),
        )
    else:
        codec = codec_device or delta.device
        payload = quantize((delta * weight).to(codec), fmt).cpu()
        tail = torch.cat([torch.tensor([weight], dtype=torch.float32), extras]).view(torch.uint8)
        packed = torch.cat([payload, tail])
        gathered = [torch.empty_like(packed) for _ in range(size)]
        work = lane.allgather([gathered], [packed])
        cut = payload.numel()

        def finish() -> tuple[torch.Tensor | None, torch.Tensor]:
            tails = [g[cut:].view(torch.float32) for g in gathered]  # in rank order: the same sums everywhere
            total = sum(float(t[0]) for t in tails)
            summed = reduce_quantized([g[:cut].to(codec) for g in gathered], fmt, delta.numel()).to(delta.device)
            return weighted_mean(summed, total), sum((t[1:] for t in tails), torch.zeros_like(extras))

        pending = PendingReduce(work, finish, (size - 1) * packed.nbytes)
    if bucket is not None:
        pending.bucket, pending.ready_at = bucket, bucket.reserve(pending.bytes_sent)
    return pending
