"""Chunked top-k payloads with low-bit values and error feedback: pure functions, no network.

SparseLoCo (arXiv 2508.15706) sends, per outer round, only the k largest-magnitude entries of
each fixed-size chunk of the flattened pseudo-gradient, their values in a few bits, and keeps
what it did not send in a per-group error-feedback buffer e (DeMo, arXiv 2411.19870, does the
same on DCT chunks):

    a = β·e + Δ        ŝ = decode(encode(a))        e ← a − ŝ

so nothing is lost, only delayed: ŝ + e_new = a (up to the rounding of the one subtraction,
none for 32-bit values or values whose difference is exact). The decayed e plays the part of DiLoCo's
outer momentum (the paper steps θ_g with plain SGD on the average of the ŝ).

Payload of ``numel`` values in C = ceil(numel / chunk) chunks of k kept entries each, one flat
uint8 tensor of fixed size (``nbytes``), so every group's payload gathers in one all_gather:

    [fp32 section | indices: C·k codes of log2(chunk) bits | values: C·k codes of b bits]

With b = 32 bits the fp32 section is the kept values themselves and there is no value
section; with b < 32 it holds two scales (lo, hi) per chunk: the smallest and largest kept
magnitude. A b-bit code is a sign bit and one of L = 2^(b−1) magnitudes evenly spaced on
[lo, hi] (L = 1: the chunk's mean kept magnitude), nearest level. The last chunk is
zero-padded; an index into the padding decodes to nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diloco.config.algo import VALUE_BITS
from diloco.outer.quantize import STEP_VALUES

CHUNK = 4096  # the paper's chunk: 64 x 64 entries, as DeMo's DCT blocks


@dataclass(frozen=True)
class TopK:
    """The codec of ``algo.compress=topk``: keep ``density`` of each ``chunk``, values in ``value_bits``."""

    density: float
    value_bits: int = 2
    chunk: int = CHUNK

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if self.value_bits not in VALUE_BITS:
            raise ValueError(f"value_bits must be one of {VALUE_BITS}, got {self.value_bits!r}")
        if self.chunk < 2:
            raise ValueError(f"chunk must be >= 2, got {self.chunk!r}")

    def width(self, numel: int) -> int:
        """The chunk length for ``numel`` values: a tensor smaller than a chunk is one chunk of its own size."""
        return max(1, min(self.chunk, numel))

    def kept(self, numel: int) -> int:
        """k, entries kept per chunk: density of the chunk, at least one."""
        return max(1, round(self.density * self.width(numel)))

    def chunks(self, numel: int) -> int:
        return math.ceil(numel / self.width(numel))

    def index_bits(self, numel: int) -> int:
        return max(1, math.ceil(math.log2(self.width(numel))))

    def nbytes(self, numel: int) -> int:
        """Exact size of ``encode`` for ``numel`` values: what one group sends to each peer."""
        _, index_end = self._layout(numel)
        if self.value_bits == 32:
            return index_end  # the values are the fp32 section
        return index_end + _packed_len(self.chunks(numel) * self.kept(numel), self.value_bits)

    def rows_per_step(self, numel: int) -> int:
        """Chunks handled at once: about ``STEP_VALUES`` values, a multiple of 8 so that every step's
        index and value codes start on a byte of the payload's bit streams."""
        return max(8, STEP_VALUES // self.width(numel) // 8 * 8)

    def steps(self, numel: int) -> list[tuple[int, int]]:
        """The chunk ranges [r0, r1) a pass over ``numel`` values takes, in order."""
        c, step = self.chunks(numel), self.rows_per_step(numel)
        return [(r0, min(c, r0 + step)) for r0 in range(0, c, step)]

    def _layout(self, numel: int) -> tuple[int, int]:
        """Where the payload's sections end: the fp32 section's bytes and the index section's."""
        n = self.chunks(numel) * self.kept(numel)
        head = 4 * n if self.value_bits == 32 else 8 * self.chunks(numel)
        return head, head + _packed_len(n, self.index_bits(numel))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of a 1-D fp32 tensor: each chunk's k largest magnitudes, indices and values."""
        if x.dim() != 1 or x.dtype != torch.float32:
            raise ValueError(f"encode takes a 1-D fp32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
        numel, width = x.numel(), self.width(x.numel())
        payload = torch.empty(self.nbytes(numel), dtype=torch.uint8, device=x.device)
        x = x.detach().contiguous()
        for r0, r1 in self.steps(numel):
            self.encode_rows(x[r0 * width : r1 * width], numel, r0, payload)
        return payload

    def encode_rows(self, piece: torch.Tensor, numel: int, r0: int, payload: torch.Tensor) -> None:
        """The values of chunks [r0, r1) (of a tensor of ``numel``) into their bytes of ``payload``, a
        buffer of ``nbytes(numel)`` allocated for it (so its fp32 section is aligned)."""
        width, k = self.width(numel), self.kept(numel)
        r1 = r0 + math.ceil(piece.numel() / width)
        head, index_end = self._layout(numel)
        if piece.numel() < (r1 - r0) * width:  # the last chunk, zero-padded
            piece = torch.cat([piece, piece.new_zeros((r1 - r0) * width - piece.numel())])
        rows = piece.view(-1, width)
        index = rows.abs().topk(k, dim=1, sorted=False).indices
        values = rows.gather(1, index)
        fp32 = payload[:head].view(torch.float32)
        index_bits = self.index_bits(numel)
        _put(payload[head:index_end], r0 * k * index_bits, _pack(index.reshape(-1), index_bits))
        if self.value_bits == 32:
            fp32[r0 * k : r1 * k] = values.reshape(-1)
            return
        scales, codes = _quantize(values, self.value_bits)
        fp32[2 * r0 : 2 * r1] = scales.reshape(-1)
        _put(payload[index_end:], r0 * k * self.value_bits, _pack(codes.reshape(-1), self.value_bits))

    def decoder(self, payload: torch.Tensor, numel: int) -> Callable[[int, int], torch.Tensor]:
        """What ``payload`` stands for, as a function of a step: the dense fp32 values of chunks [r0, r1)
        (the last one's padding cut off), zeros but at the kept entries. The bytes are checked once."""
        expected = self.nbytes(numel)
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
            raise ValueError(
                f"a topk payload of {numel} values must be a 1-D uint8 tensor of {expected} bytes, "
                f"got {payload.dtype} of shape {tuple(payload.shape)}"
            )
        width, k, index_bits = self.width(numel), self.kept(numel), self.index_bits(numel)
        head, index_end = self._layout(numel)
        fp32 = _as_float(payload[:head])

        def rows(r0: int, r1: int) -> torch.Tensor:
            m = (r1 - r0) * k
            index = _unpack(_take(payload[head:index_end], r0 * k * index_bits, m, index_bits), index_bits, m)
            if self.value_bits == 32:
                values = fp32[r0 * k : r1 * k].view(-1, k)
            else:
                codes = _unpack(
                    _take(payload[index_end:], r0 * k * self.value_bits, m, self.value_bits), self.value_bits, m
                )
                values = _dequantize(fp32[2 * r0 : 2 * r1].view(-1, 2), codes.view(-1, k), self.value_bits)
            out = torch.zeros(r1 - r0, width, dtype=torch.float32, device=payload.device)
            out.scatter_(1, index.view(-1, k), values)
            return out.view(-1)[: min(numel, r1 * width) - r0 * width]

        return rows

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 tensor of ``numel`` values ``payload`` stands for: zeros but at the kept entries."""
        rows = self.decoder(payload, numel)
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        width = self.width(numel)
        for r0, r1 in self.steps(numel):
            out[r0 * width : r1 * width] = rows(r0, r1)
        return out


def feedback(codec: TopK, delta: torch.Tensor, error: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One round of error feedback: (payload, the new e = a − ŝ), a = β·e + Δ, ŝ what the payload decodes to.

    The new e is written over ``delta`` (the round's own buffer), a step at a time once that step's a
    is taken, and ŝ is a step's temporary: a round adds nothing of the model's size but the payload.
    β = 0 is no feedback: a = Δ (0·e is exact for a finite e).
    """
    numel, width = delta.numel(), codec.width(delta.numel())
    payload = torch.empty(codec.nbytes(numel), dtype=torch.uint8, device=delta.device)
    decoded = codec.decoder(payload, numel)  # views of the payload: each step reads the bytes just written
    for r0, r1 in codec.steps(numel):  # a, ŝ and e a step at a time, element by element as over the whole
        span = slice(r0 * width, r1 * width)
        accumulated = delta[span] + decay * error[span] if decay else delta[span].clone()
        codec.encode_rows(accumulated, numel, r0, payload)
        torch.sub(accumulated, decoded(r0, r1), out=delta[span])
    return payload, delta


def outgoing(
    codec: TopK, delta: torch.Tensor, error: torch.Tensor, decay: float, weight: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a group sends this round (on the CPU) and the e it keeps if the round commits, encoded on ``device``
    (on the CPU, e is written over ``delta``: ``feedback``).

    At weight 0 (a healing group, or a non-finite Δ) Δ is not the group's work: a blank payload
    of the same size, so the gather keeps its shape, and e stays as it was.
    """
    if weight <= 0:
        return torch.zeros(codec.nbytes(delta.numel()), dtype=torch.uint8), error
    payload, new_error = feedback(codec, delta.to(device), error.to(device), decay)
    return payload.cpu(), new_error.cpu()


def reduce_sparse(
    gathered: list[torch.Tensor], weights: list[float], codec: TopK, numel: int, reference_groups: int = 0
) -> torch.Tensor:
    """Σ_m w_m·ŝ_m in fp32, in list (rank) order, so every group gets the same bits; a w_m = 0 adds nothing.

    With N = ``reference_groups`` and M > N contributing groups, entry i is scaled by W / max(S_i, N·W/M)
    (W = Σ_m w_m, S_i = Σ of the weights of the groups that sent i), so that the caller's division by W
    averages it over its senders but over no fewer than N groups' worth of weight: an entry every group
    sent keeps the plain mean, one sent by a single group of M equal ones is ŝ/N instead of ŝ/M.
    """
    if len(gathered) != len(weights) or not gathered:
        raise ValueError(f"need one weight per payload, got {len(gathered)} payloads and {len(weights)} weights")
    contributing = [w for w in weights if w]
    scaled = 0 < reference_groups < len(contributing)
    total = torch.zeros(numel, dtype=torch.float32, device=gathered[0].device)
    senders = torch.zeros_like(total) if scaled else None
    decoders = [(codec.decoder(payload, numel), weight) for payload, weight in zip(gathered, weights) if weight]
    width = codec.width(numel)
    for r0, r1 in codec.steps(numel):  # each entry summed in list order, as over the whole
        span = slice(r0 * width, r1 * width)
        for rows, weight in decoders:
            sent = rows(r0, r1)
            total[span] += sent * weight
            if senders is not None:
                senders[span] += (sent != 0) * weight
    if senders is None:
        return total
    whole = sum(contributing)
    return total * (whole / senders.clamp(min=reference_groups * whole / len(contributing)))


def _quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk (row): scales [lo, hi] of the kept magnitudes and each value's b-bit code, sign bit on top."""
    levels = 1 << (bits - 1)
    magnitude = values.abs()
    if levels == 1:
        mean = magnitude.mean(dim=1)
        scales = torch.stack([mean, mean], dim=1)
        level = torch.zeros_like(magnitude, dtype=torch.int64)
    else:
        scales = torch.stack([magnitude.amin(dim=1), magnitude.amax(dim=1)], dim=1)
        step = _step(scales, levels)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        level = ((magnitude - scales[:, :1]) / safe).round().clamp(0, levels - 1).to(torch.int64)
    sign = (values < 0).to(torch.int64) << (bits - 1)
    return scales, sign | level


def _dequantize(scales: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The values the codes stand for: ±(lo + level·(hi − lo)/(L − 1)); the inverse of ``_quantize``."""
    levels = 1 << (bits - 1)
    magnitude = scales[:, :1] + (codes & (levels - 1)).to(torch.float32) * _step(scales, levels)
    return torch.where((codes >> (bits - 1)).bool(), -magnitude, magnitude)


def _step(scales: torch.Tensor, levels: int) -> torch.Tensor:
    """(hi − lo) / (L − 1) per chunk as a column; 0 for L = 1. A 0-d tensor divisor, as quantize.py's."""
    if levels == 1:
        return torch.zeros_like(scales[:, :1])
    return (scales[:, 1:] - scales[:, :1]) / torch.tensor(float(levels - 1), device=scales.device)


def _packed_len(n: int, bits: int) -> int:
    return math.ceil(n * bits / 8)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative int codes < 2^bits, ``bits`` each, little-endian bit order, into ceil(n·bits/8) bytes."""
    shifts = torch.arange(bits, device=codes.device)
    bits_flat = ((codes[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = (-bits_flat.numel()) % 8
    if pad:
        bits_flat = torch.cat([bits_flat, bits_flat.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=codes.device)
    return (bits_flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` int64 codes ``_pack`` wrote into ``packed``."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    flat = ((packed[:, None] >> shifts) & 1).reshape(-1)[: n * bits].view(n, bits).to(torch.int64)
    weights = torch.tensor([1 << i for i in range(bits)], dtype=torch.int64, device=packed.device)
    return (flat * weights).sum(dim=1)


def _put(stream: torch.Tensor, bit: int, packed: torch.Tensor) -> None:
    """A step's packed codes into a bit stream at ``bit``, a multiple of 8 (``rows_per_step``)."""
    stream[bit // 8 : bit // 8 + packed.numel()] = packed


def _take(stream: torch.Tensor, bit: int, n: int, bits: int) -> torch.Tensor:
    """The bytes of ``n`` codes of ``bits`` each starting at ``bit``, a multiple of 8."""
    return stream[bit // 8 : bit // 8 + _packed_len(n, bits)]


def _as_float(u8: torch.Tensor) -> torch.Tensor:
    """View bytes as fp32; copy first when the slice is not 4-byte aligned."""
    try:
        return u8.view(torch.float32)
    except RuntimeError:
        return u8.clone().view(torch.float32)
