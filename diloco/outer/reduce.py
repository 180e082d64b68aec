"""The outer reduce of one fragment's pseudo-gradient over a lane, in the job's payload codec (``codecs``).

A dense payload (fp32 ``w·Δ``) is summed with a Gloo all-reduce; a packed one is all-gathered
(Gloo has no reduction for packed bytes) and each worker decodes and sums every member's in
fp32 in rank order, so every group gets the same bits. The weight w (1, or the tokens a group
processed; 0 for a group that only heals) rides along, so the average is over the groups that
contributed, and so may a few extra numbers each member adds to the sum (``algo.auto``'s
measurements).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diloco.outer.bandwidth import TokenBucket
from diloco.outer.update import weighted_mean


@dataclass
class PendingReduce:
    """An all-reduce in flight; ``result`` waits (bounded by the caller) and averages.

    ``extras``: the sum over the lane of every member's extra numbers (``codecs.launch_reduce``),
    the same bits on every member, set once ``result`` returned.
    """

    work: dist.Work
    finish: Callable[[], tuple[torch.Tensor | None, torch.Tensor]]
    bytes_sent: int
    ready_at: float = 0.0  # with a bandwidth limit: when the link has carried bytes_sent
    bucket: TokenBucket | None = None
    extras: torch.Tensor | None = None
    error: torch.Tensor | None = None  # the e this member keeps if the round commits (error feedback)

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


def sum_over_lane(
    lane: dist.ProcessGroup, payload: torch.Tensor, weight: float, extras: torch.Tensor, size: int
) -> PendingReduce:
    """All-reduce the fp32 ``payload`` (w·Δ) behind which the weight and extras ride; ``finish`` averages."""
    n = payload.numel()
    buffer = torch.cat([payload, torch.tensor([weight], dtype=torch.float32), extras])
    work = lane.allreduce([buffer])
    return PendingReduce(
        work,
        lambda: (weighted_mean(buffer[:n], float(buffer[n])), buffer[n + 1 :]),
        ring_allreduce_bytes(buffer.nbytes, size),
    )


def gather_and_sum(
    lane: dist.ProcessGroup,
    payload: torch.Tensor,
    weight: float,
    extras: torch.Tensor,
    size: int,
    decode_sum: Callable[[list[torch.Tensor], list[float]], torch.Tensor],
) -> PendingReduce:
    """All-gather ``payload`` behind the weight and extras; ``finish`` averages ``decode_sum`` over members.

    The float32 head first, so it and the payload start 4-byte aligned in every received buffer.
    """
    head = torch.cat([torch.tensor([weight], dtype=torch.float32), extras]).view(torch.uint8)
    packed = torch.cat([head, payload])
    gathered = [torch.empty_like(packed) for _ in range(size)]
    work = lane.allgather([gathered], [packed])
    cut = head.numel()

    def finish() -> tuple[torch.Tensor | None, torch.Tensor]:
        heads = [g[:cut].view(torch.float32) for g in gathered]  # in rank order: the same sums everywhere
        weights = [float(h[0]) for h in heads]
        summed = decode_sum([g[cut:] for g in gathered], weights)
        return weighted_mean(summed, sum(weights)), sum((h[1:] for h in heads), torch.zeros_like(extras))

    return PendingReduce(work, finish, (size - 1) * packed.nbytes)


def as_float32(extras: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.float32) if extras is None else extras.to(torch.float32)


def held_back(pending: PendingReduce, bucket: TokenBucket | None) -> PendingReduce:
    """With a ``bucket``, the result waits until the link has carried the bytes this member sends."""
    if bucket is not None:
        pending.bucket, pending.ready_at = bucket, bucket.reserve(pending.bytes_sent)
    return pending
