"""Payload codecs: how one group's Δ goes on the wire, and how every group's comes back summed.

One codec per job, chosen from the algo config (``codec_for``); ``algo.auto`` chooses again when
it changes the format. ``Dense`` sends fp32 w·Δ, which the lane sums (a ring all-reduce). The
others send packed bytes, which Gloo cannot sum: every group gathers all payloads and sums
Σ_m w_m·Δ̂_m in fp32 in rank order, so all get the same bits. ``Quantized`` sends w·Δ in a low-bit
format (``quantize``); ``Sparse`` sends the top-k of a = β·e + Δ (``sparse``: unweighted, the error
feedback is on the group's own Δ) and hands back e ← a − ŝ, which the caller keeps per fragment.

The weight w (1, or the tokens a group processed; 0 for a group that only heals) rides along with
every payload, so the average is over the groups that contributed, and so may a few extra numbers
each member adds to the sum (``algo.auto``'s measurements).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from diloco.config.algo import AlgoConfig
from diloco.outer.bandwidth import TokenBucket
from diloco.outer.phases import PhaseClock
from diloco.outer.quantize import packed_nbytes, quantize, reduce_quantized
from diloco.outer.sparse import TopK, outgoing, reduce_sparse
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
    error: torch.Tensor | None = None  # the e this member keeps if the round commits (error feedback)

    def result(self, wait: Callable[[dist.Work], None], clock: PhaseClock | None = None) -> torch.Tensor | None:
        """The weighted mean Δ̄ over contributing groups, or None if nobody contributed; ``clock``
        times the wait (``wire``) and the decode."""
        clock = clock or PhaseClock()
        with clock.timed("wire"):
            wait(self.work)
            if self.bucket is not None:
                self.bucket.wait_until(self.ready_at)
        with clock.timed("decode"):
            mean, self.extras = self.finish()
        return mean


class Codec(Protocol):
    """The payload of one group's Δ of ``numel`` values, and the collective that combines them."""

    name: str  # as the job's header prints it

    def nbytes(self, numel: int) -> int:
        """Bytes of one group's payload."""

    def bytes_sent(self, numel: int, size: int, n_extras: int = 0) -> int:
        """Bytes one of ``size`` members sends for it, with the weight and ``n_extras`` float32 beside."""

    def error_buffer(self, numel: int) -> torch.Tensor | None:
        """A fresh e for a fragment (None: no error feedback)."""

    def encode(
        self, delta: torch.Tensor, weight: float, error: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This group's payload for w and Δ (on the CPU), and the e to keep if the round commits (None: no e).
        Δ is the round's own buffer: a codec may scale it in place."""

    def send(
        self,
        lane: dist.ProcessGroup,
        payload: torch.Tensor,
        numel: int,
        weight: float,
        extras: torch.Tensor,
        size: int,
        staging: torch.Tensor | None,
    ) -> PendingReduce:
        """Start combining every member's payload, weight and ``extras`` over the lane; ``staging``: the
        buffer Δ was written into, with room behind it for the weight and extras (``launch_reduce``)."""


def _tail(n_extras: int) -> int:
    return 4 * (1 + n_extras)  # the weight and the extras, float32


@dataclass(frozen=True)
class Dense:
    """fp32 w·Δ, summed by the lane."""

    name: str = "fp32"

    def nbytes(self, numel: int) -> int:
        return packed_nbytes(numel, "none")

    def bytes_sent(self, numel: int, size: int, n_extras: int = 0) -> int:
        return ring_allreduce_bytes(self.nbytes(numel) + _tail(n_extras), size)

    def error_buffer(self, numel: int) -> None:
        return None

    def encode(self, delta: torch.Tensor, weight: float, error: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        return (delta if weight == 1.0 else delta.mul_(weight)), None  # 1·Δ is Δ, bit for bit: no pass over it

    def send(
        self,
        lane: dist.ProcessGroup,
        payload: torch.Tensor,
        numel: int,
        weight: float,
        extras: torch.Tensor,
        size: int,
        staging: torch.Tensor | None,
    ) -> PendingReduce:
        return sum_over_lane(lane, payload, weight, extras, size, staging)


class Gathered:
    """A packed payload: gathered from every member, then ``reduce`` decodes and sums it."""

    def bytes_sent(self, numel: int, size: int, n_extras: int = 0) -> int:
        return (size - 1) * (self.nbytes(numel) + _tail(n_extras))

    def send(
        self,
        lane: dist.ProcessGroup,
        payload: torch.Tensor,
        numel: int,
        weight: float,
        extras: torch.Tensor,
        size: int,
        staging: torch.Tensor | None,
    ) -> PendingReduce:
        return gather_and_sum(lane, payload, weight, extras, size, lambda gathered, w: self.reduce(gathered, w, numel))


@dataclass(frozen=True)
class Quantized(Gathered):
    """w·Δ in ``fmt``, encoded and decoded on ``device`` (a worker's GPU; None: the CPU)."""

    fmt: str
    device: torch.device | None = None

    @property
    def name(self) -> str:
        return self.fmt

    def nbytes(self, numel: int) -> int:
        return packed_nbytes(numel, self.fmt)

    def error_buffer(self, numel: int) -> None:
        return None

    def encode(self, delta: torch.Tensor, weight: float, error: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        return quantize(delta.mul_(weight).to(self.device or delta.device), self.fmt).cpu(), None

    def reduce(self, gathered: list[torch.Tensor], weights: list[float], numel: int) -> torch.Tensor:
        """Σ_m w_m·Δ_m: the payloads already hold w_m·Δ_m."""
        device = self.device or gathered[0].device
        return reduce_quantized([p.to(device) for p in gathered], self.fmt, numel).cpu()


@dataclass(frozen=True)
class Sparse(Gathered):
    """SparseLoCo's payload: ``topk`` of a = β·e + Δ, β = ``decay``; entries averaged over no fewer
    than ``reference_groups`` groups (``reduce_sparse``); encoded and decoded on ``device``."""

    topk: TopK
    decay: float
    reference_groups: int = 0
    device: torch.device | None = None

    @property
    def name(self) -> str:
        return f"top {100 * self.topk.density:g}% in {self.topk.value_bits}-bit values"

    def nbytes(self, numel: int) -> int:
        return self.topk.nbytes(numel)

    def error_buffer(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32)

    def encode(
        self, delta: torch.Tensor, weight: float, error: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return outgoing(self.topk, delta, error, self.decay, weight, self.device or delta.device)

    def reduce(self, gathered: list[torch.Tensor], weights: list[float], numel: int) -> torch.Tensor:
        device = self.device or gathered[0].device
        payloads = [p.to(device) for p in gathered]
        return reduce_sparse(payloads, weights, self.topk, numel, self.reference_groups).cpu()


def launch_reduce(
    lane: dist.ProcessGroup,
    delta: torch.Tensor,
    weight: float,
    codec: Codec,
    size: int,
    error: torch.Tensor | None = None,
    extras: torch.Tensor | None = None,
    bucket: TokenBucket | None = None,
    clock: PhaseClock | None = None,
    staging: torch.Tensor | None = None,
) -> PendingReduce:
    """Start summing ``codec``'s payload of ``weight * delta``, ``weight`` and the float32 ``extras``
    over the lane, without waiting; ``error``: this group's e, if the codec feeds it back; ``clock``
    times the encode. ``delta`` is the round's own: the codec may scale it in place, and with
    ``staging`` (the buffer ``delta`` heads, with room behind it) the dense sum runs in that buffer.

    With a ``bucket`` the result is held back until the link has carried the bytes this member sends.
    Every codec step is elementwise IEEE arithmetic, so the bits on a worker's GPU equal the CPU's
    and groups on different devices still agree.
    """
    with (clock or PhaseClock()).timed("encode"):
        payload, kept = codec.encode(delta, weight, error)
    pending = codec.send(lane, payload, delta.numel(), weight, as_float32(extras), size, staging)
    pending.error = kept
    return held_back(pending, bucket)


def format_codec(fmt: str, device: torch.device | None = None) -> Dense | Quantized:
    """The codec of ``algo.quantize=fmt``: none is the dense all-reduce."""
    return Dense() if fmt == "none" else Quantized(fmt, device)


def codec_for(algo: AlgoConfig, device: torch.device | None = None) -> Codec:
    """The codec ``algo`` asks for: ``algo.compress=topk``'s, else ``algo.quantize``'s."""
    if algo.compress == "topk":
        topk = TopK(algo.density, algo.value_bits)
        return Sparse(topk, algo.error_decay, algo.sparse_reference_groups, device)
    return format_codec(algo.quantize, device)


# --- the collectives ----------------------------------------------------------------------------


def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    """Bytes one member sends in a ring all-reduce: reduce-scatter plus all-gather."""
    return 2 * (size - 1) * nbytes // size


def sum_over_lane(
    lane: dist.ProcessGroup,
    payload: torch.Tensor,
    weight: float,
    extras: torch.Tensor,
    size: int,
    staging: torch.Tensor | None = None,
) -> PendingReduce:
    """All-reduce the fp32 ``payload`` (w·Δ) behind which the weight and extras ride; ``finish`` averages.

    In ``staging`` when ``payload`` heads it and the tail fits behind (no copy of the model's size),
    else in a new buffer.
    """
    n = payload.numel()
    tail = torch.cat([torch.tensor([weight], dtype=torch.float32), extras])
    if staging is not None and staging.data_ptr() == payload.data_ptr() and staging.numel() >= n + tail.numel():
        buffer = staging[: n + tail.numel()]
        buffer[n:] = tail
    else:
        buffer = torch.cat([payload, tail])
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
