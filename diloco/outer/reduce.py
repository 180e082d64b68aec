"""The outer all-reduce of one fragment's pseudo-gradient over a lane, optionally quantized or sparse.

``none`` sums fp32 ``w·Δ`` with a Gloo all-reduce. Quantized formats all-gather every
group's packed ``w·Δ`` (Gloo has no reduction for packed bytes) and each worker dequantizes
and sums in fp32 in rank order, so every group gets the same bits. Sparse payloads
(``algo.compress=topk``) are gathered the same way, as encoded (unweighted: the group's error
feedback is on its own Δ), and each worker sums w·decode in rank order. The weight w (1, or the
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
from diloco.outer.sparse import TopK, reduce_sparse
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


def bytes_sent_for(numel: int, fmt: str, size: int, n_extras: int = 0, sparse: TopK | None = None) -> int:
    """Bytes one member sends to reduce ``numel`` values in ``fmt`` (or ``sparse``'s payload, as
    ``launch_sparse_reduce`` does) over ``size`` members, as ``launch_reduce`` does."""
    tail = 4 * (1 + n_extras)  # the weight and the extras, float32
    if sparse is not None:
        return (size - 1) * (sparse.nbytes(numel) + tail)
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
    extras = _as_float32(extras)
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

        def decode_sum(payloads: list[torch.Tensor], _: list[float]) -> torch.Tensor:
            return reduce_quantized([p.to(codec) for p in payloads], fmt, delta.numel()).to(delta.device)

        pending = _gather_and_sum(lane, payload, weight, extras, size, decode_sum)
    return _held_back(pending, bucket)


def launch_sparse_reduce(
    lane: dist.ProcessGroup,
    payload: torch.Tensor,
    numel: int,
    weight: float,
    codec: TopK,
    size: int,
    extras: torch.Tensor | None = None,
    bucket: TokenBucket | None = None,
    codec_device: torch.device | None = None,
    reference_groups: int = 0,
) -> PendingReduce:
    """Start gathering every member's ``codec`` payload of ``numel`` values, its weight and extras.

    Every member sends a payload of the same size whatever it holds (a healing group: zeros, weight
    0), so the gather has one shape. ``result`` is Σ w_m·ŝ_m / Σ w_m on the CPU, in fp32, each entry
    averaged over no fewer than ``reference_groups`` groups (``reduce_sparse``).
    """
    extras = _as_float32(extras)
    device = codec_device or payload.device

    def decode_sum(payloads: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        gathered = [p.to(device) for p in payloads]
        return reduce_sparse(gathered, weights, codec, numel, reference_groups).cpu()

    pending = _gather_and_sum(lane, payload.cpu(), weight, extras, size, decode_sum)
    return _held_back(pending, bucket)


def _gather_and_sum(
    lane: dist.ProcessGroup,
    payload: torch.Tensor,
    weight: float,
    extras: torch.Tensor,
    size: int,
    decode_sum: Callable[[list[torch.Tensor], list[float]], torch.Tensor],
) -> PendingReduce:
    """All-gather ``payload`` behind the weight and extras; ``finish`` sums ``decode_sum`` over members.

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


def _as_float32(extras: torch.Tensor | None) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.float32) if extras is None else extras.to(torch.float32)


def _held_back(pending: PendingReduce, bucket: TokenBucket | None) -> PendingReduce:
    """With a ``bucket``, the result waits until the link has carried the bytes this member sends."""
    if bucket is not None:
        pending.bucket, pending.ready_at = bucket, bucket.reserve(pending.bytes_sent)
    return pending
