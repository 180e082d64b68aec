"""Quantized payloads for the outer all-reduce: pure functions from fp32 tensors to bytes and back.

Streaming DiLoCo (arXiv 2501.18512) exchanges pseudo-gradients Δ in low precision (down to 4
bits) with no loss in quality, as long as they are accumulated in fp32. A payload is ONE flat
uint8 tensor, so a single all_gather moves it; each group then dequantizes every peer's
payload and sums in fp32 (``reduce_quantized``), in the same order on every group, so all
groups get bit-identical sums.

Formats and bytes per element (block formats carry one fp32 absmax scale per ``block``):

=======  ============================  =======================================
none     fp32, exact                   4
bf16     bfloat16, round to nearest    2
fp8      e4m3 (max 448) × scale        1 + 4/block
int8     symmetric [-127, 127] × scale 1 + 4/block
fp4      e2m1 (max 6) × scale          0.5 + 4/block (two codes per byte)
=======  ============================  =======================================

Block layout: [scales as fp32 bytes | payload]. The scales come first so they sit at a
4-byte aligned offset of a freshly received buffer. The last block is zero-padded for the
absmax; the payload holds only ``numel`` values (fp4: ceil(numel/2) bytes).

Every value's code depends only on its block, so encode and decode run a chunk of whole blocks
at a time: each of their dozen elementwise steps then passes over a cache's worth of values,
not over the model's (a fragment of 38M values is 150 MB a step), with the same bits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

FORMATS = ("none", "bf16", "fp8", "int8", "fp4")
DEFAULT_BLOCK = 128

_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
_INT8_MAX = 127.0
# E2M1 magnitudes by code 0..7; bit 3 of a code is the sign.
_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_MAX = 6.0
# Midpoints between neighbouring magnitudes: the rounding thresholds.
_FP4_MIDPOINTS = tuple((a + b) / 2 for a, b in itertools.pairwise(_FP4_GRID))

_MAXIMA = {"fp8": _FP8_MAX, "int8": _INT8_MAX, "fp4": _FP4_MAX}
# Values an encode, decode or sum step works on at once, here and in the sparse codec: 1 MB of fp32, a
# cache's worth, not the model's.
STEP_VALUES = 1 << 18


def _check(fmt: str, block: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"quantization block must be a positive integer, got {block!r}")


def _n_blocks(numel: int, block: int) -> int:
    return math.ceil(numel / block)


def _chunk(block: int) -> int:
    """Values a chunk: whole blocks, about ``STEP_VALUES``, and even, so no fp4 byte straddles two chunks."""
    values = max(1, STEP_VALUES // block) * block
    return values * (values % 2 + 1)


def packed_nbytes(numel: int, fmt: str, block: int = DEFAULT_BLOCK) -> int:
    """Exact size in bytes of ``quantize(x, fmt, block)`` for ``x.numel() == numel``."""
    _check(fmt, block)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if fmt == "none":
        return 4 * numel
    if fmt == "bf16":
        return 2 * numel
    scales = 4 * _n_blocks(numel, block)
    return scales + (math.ceil(numel / 2) if fmt == "fp4" else numel)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _reinterpret(u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View bytes as ``dtype``; copy first when the offset is not aligned for it."""
    try:
        return u8.view(dtype)
    except RuntimeError:
        return u8.clone().view(dtype)


def _blockwise(x: torch.Tensor, block: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x zero-padded to whole blocks as [n_blocks, block] divided by its scale, and the scales.

    scale = absmax / qmax, so each block's largest magnitude maps to the format's largest
    value. An all-zero block has scale 0 and maps to zeros (no 0/0).
    """
    n = x.numel()
    if n % block:
        padded = torch.zeros(_n_blocks(n, block) * block, dtype=torch.float32, device=x.device)
        padded[:n] = x
        x = padded
    rows = x.view(-1, block)
    # A 0-d tensor, not a Python float: CUDA divides by a Python scalar as a multiply by its
    # reciprocal, which rounds differently, and every codec device must give the same bits.
    scales = rows.abs().amax(dim=1) / torch.tensor(qmax, device=x.device)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return rows / safe[:, None], scales


def _fp4_encode(y: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of the E2M1 values nearest to y, ties to the even code (as OCP MX).

    The code of a magnitude is the number of midpoints it passes. A magnitude exactly on the
    midpoint between codes i and i+1 passes it only when i+1 is even. Seven comparisons are
    several times faster than ``bucketize`` plus a tie fix-up on the CPU.
    """
    magnitude = y.abs()
    code = (y < 0).to(torch.uint8) << 3
    for i, midpoint in enumerate(_FP4_MIDPOINTS):
        code += magnitude.ge(midpoint) if i % 2 else magnitude.gt(midpoint)
    return code


def _fp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte: element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _fp4_lut(device: torch.device) -> torch.Tensor:
    """The value of each code 0..15."""
    grid = torch.tensor(_FP4_GRID, dtype=torch.float32, device=device)
    return torch.cat([grid, -grid])


def _fp4_decode(packed: torch.Tensor, numel: int, lut: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel]
    return lut[codes.long()]


def _codes(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """The payload bytes of ``y`` (values already divided by their block's scale)."""
    if fmt == "fp8":
        # The clamp only guards rounding in x / scale; torch's cast would give NaN above 448.
        return _as_bytes(y.clamp(-_FP8_MAX, _FP8_MAX).to(_FP8))
    if fmt == "int8":
        return _as_bytes(y.round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8))
    return _fp4_pack(_fp4_encode(y))


def quantize(x: torch.Tensor, fmt: str, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """A 1-D fp32 tensor as one flat uint8 payload of ``packed_nbytes(x.numel(), fmt, block)`` bytes.

    Rounds to nearest: bf16 and fp8 by torch's casts (ties to even), int8 by ``round``
    (ties to even), fp4 to the nearest E2M1 value (ties to the even code). The block
    formats need finite values (an inf or NaN would poison its block's scale).
    """
    _check(fmt, block)
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"quantize takes a 1-D fp32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    x = x.detach().contiguous()  # its chunks are viewed as rows of blocks
    if fmt == "none":
        return _as_bytes(x.clone())
    if fmt == "bf16":
        return _as_bytes(x.to(torch.bfloat16))
    n, nb = x.numel(), _n_blocks(x.numel(), block)
    packed = torch.empty(packed_nbytes(n, fmt, block), dtype=torch.uint8, device=x.device)
    scales, payload = packed[: 4 * nb].view(torch.float32), packed[4 * nb :]  # a new buffer: aligned
    step = _chunk(block)
    for start in range(0, n, step):
        piece = x[start : start + step]
        if not torch.isfinite(piece).all():
            raise ValueError(f"quantize({fmt}) needs finite values; the tensor holds inf or NaN")
        y, piece_scales = _blockwise(piece, block, _MAXIMA[fmt])
        scales[start // block : start // block + piece_scales.numel()] = piece_scales
        codes = _codes(y.reshape(-1)[: piece.numel()], fmt)
        at = start // 2 if fmt == "fp4" else start
        payload[at : at + codes.numel()] = codes
    return packed


def _decoder(packed: torch.Tensor, fmt: str, numel: int, block: int) -> Callable[[int, int], torch.Tensor]:
    """What ``quantize`` encoded in ``packed``, as a function of a chunk: values [start, stop) in fp32
    (``start`` a multiple of ``_chunk(block)``). The bytes are checked and the scales read once."""
    _check(fmt, block)
    expected = packed_nbytes(numel, fmt, block)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
        raise ValueError(
            f"packed {fmt} payload of {numel} values must be a 1-D uint8 tensor of {expected} bytes, "
            f"got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    if fmt in ("none", "bf16"):
        values = _reinterpret(packed, torch.float32 if fmt == "none" else torch.bfloat16)
        return lambda start, stop: values[start:stop].float()
    nb = _n_blocks(numel, block)
    scales = _reinterpret(packed[: 4 * nb], torch.float32)
    payload = packed[4 * nb :]
    lut = _fp4_lut(packed.device) if fmt == "fp4" else None

    def chunk(start: int, stop: int) -> torch.Tensor:
        if fmt == "fp8":
            values = payload[start:stop].view(_FP8).float()
        elif fmt == "int8":
            values = payload[start:stop].view(torch.int8).float()
        else:
            values = _fp4_decode(payload[start // 2 : (stop + 1) // 2], stop - start, lut)
        first = start // block
        return values * scales[first : _n_blocks(stop, block)].repeat_interleave(block)[: stop - start]

    return chunk


def dequantize(packed: torch.Tensor, fmt: str, numel: int, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """The fp32 tensor of ``numel`` values that ``quantize`` encoded in ``packed`` (a sum of one)."""
    return reduce_quantized([packed], fmt, numel, block)


def reduce_quantized(gathered: list[torch.Tensor], fmt: str, numel: int, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """The fp32 sum of the dequantized payloads, accumulated in list order.

    Every group sums the same payloads in the same (rank) order, so every group gets the
    same bits; divide by the number of contributors for the mean. Chunk by chunk: each value
    is still the first payload's plus the second's plus ..., in that order.
    """
    if not gathered:
        raise ValueError("reduce_quantized needs at least one payload")
    decoders = [_decoder(packed, fmt, numel, block) for packed in gathered]
    total = torch.empty(numel, dtype=torch.float32, device=gathered[0].device)
    step = _chunk(block)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        part = total[start:stop]
        part.copy_(decoders[0](start, stop))
        for decode in decoders[1:]:
            part += decode(start, stop)
    return total
