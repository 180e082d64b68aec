"""Quantized all-reduce payloads: exact sizes, error bounds per format, padding, zeros, fp32 reduction."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.outer import quantize as quantize_module
from diloco.outer.quantize import DEFAULT_BLOCK, FORMATS, dequantize, packed_nbytes, quantize, reduce_quantized

BLOCK_FORMATS = ("fp8", "int8", "fp4")
QMAX = {"fp8": 448.0, "int8": 127.0, "fp4": 6.0}
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def roundtrip(x: torch.Tensor, fmt: str, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    packed = quantize(x, fmt, block)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    assert packed.numel() == packed_nbytes(x.numel(), fmt, block)
    return dequantize(packed, fmt, x.numel(), block)


def sample(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 1e-3  # pseudo-gradient sized
    if kind == "outliers":
        idx = torch.randint(0, n, (max(1, n // 100),), generator=g)
        x[idx] *= 1000.0
    return x


def block_scales(x: torch.Tensor, block: int, qmax: float) -> torch.Tensor:
    """Per-element scale = its block's absmax / qmax (reference, independent of the module)."""
    n = x.numel()
    padded = torch.cat([x, x.new_zeros(-n % block)])
    scales = padded.view(-1, block).abs().amax(dim=1) / qmax
    return scales.repeat_interleave(block)[:n]


# --- sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 127, 128, 129, 255, 256, 1000])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", [1, 16, 128])
def test_packed_nbytes_is_exact(numel, fmt, block):
    x = torch.randn(numel)
    assert quantize(x, fmt, block).numel() == packed_nbytes(numel, fmt, block)
    assert roundtrip(x, fmt, block).shape == (numel,)


def test_bytes_per_element():
    n, b = 128 * 1000, 128
    nblocks = n // b
    assert packed_nbytes(n, "none", b) == 4 * n
    assert packed_nbytes(n, "bf16", b) == 2 * n
    assert packed_nbytes(n, "int8", b) == n + 4 * nblocks
    assert packed_nbytes(n, "fp8", b) == n + 4 * nblocks
    assert packed_nbytes(n, "fp4", b) == n // 2 + 4 * nblocks  # 0.5 + 4/128 bytes per element
    # Padding: 129 values make 2 blocks (8 bytes of scales); fp4 needs ceil(129 / 2) = 65 bytes.
    assert packed_nbytes(129, "fp4", 128) == 65 + 8
    assert packed_nbytes(129, "int8", 128) == 129 + 8


# --- error bounds ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_none_is_exact(kind):
    x = sample(kind, 1000, 0)
    assert torch.equal(roundtrip(x, "none"), x)


@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_bf16_relative_error(kind):
    x = sample(kind, 5000, 1)
    y = roundtrip(x, "bf16")
    assert ((y - x).abs() <= x.abs() * 2.0**-8).all()


@pytest.mark.parametrize("kind", ["normal", "outliers"])
@pytest.mark.parametrize("block", [32, 128])
def test_int8_error_at_most_half_a_step(kind, block):
    x = sample(kind, 5000 + 17, 2)
    y = roundtrip(x, "int8", block)
    scale = block_scales(x, block, 127.0)
    # Half a quantization step, plus fp32 rounding of x/scale and q·scale.
    assert ((y - x).abs() <= scale * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_fp8_relative_error_in_normal_range(kind):
    x = sample(kind, 5000 + 3, 3)
    y = roundtrip(x, "fp8")
    scale = block_scales(x, DEFAULT_BLOCK, 448.0)
    err = (y - x).abs()
    normal = x.abs() >= scale * 2.0**-6  # e4m3's smallest normal is 2^-6
    assert normal.float().mean() > 0.9
    assert (err[normal] <= x.abs()[normal] * 2.0**-4 * (1 + 1e-5)).all()
    # Subnormals: half of e4m3's subnormal spacing 2^-9.
    assert (err[~normal] <= scale[~normal] * 2.0**-10 * (1 + 1e-5)).all()


@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_fp4_error_at_most_half_the_largest_gap(kind):
    x = sample(kind, 5000 + 5, 4)
    y = roundtrip(x, "fp4")
    scale = block_scales(x, DEFAULT_BLOCK, 6.0)
    assert ((y - x).abs() <= scale * (1.0 + 1e-5)).all()
    # Every value is a signed E2M1 value times its block's scale.
    ratio = torch.where(scale > 0, y / torch.where(scale > 0, scale, 1.0), 0.0).abs()
    assert torch.isclose(ratio[:, None], FP4_VALUES[None, :], rtol=1e-5, atol=1e-6).any(dim=1).all()


def test_fp4_rounds_to_nearest_with_ties_to_even_code():
    # One block with absmax 6 has scale 1, so these are the E2M1 values themselves.
    x = torch.tensor([6.0, 0.2, 0.3, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, -4.9, -0.74, 2.9])
    want = torch.tensor([6.0, 0.0, 0.5, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0, -0.5, 3.0])
    assert torch.equal(roundtrip(x, "fp4", block=len(x)), want)


def test_int8_rounds_to_nearest():
    # absmax 127 → scale 1: the values round to the nearest integer.
    x = torch.tensor([127.0, 0.4, 0.6, -3.7, -127.0, 10.49])
    assert torch.equal(roundtrip(x, "int8", block=len(x)), torch.tensor([127.0, 0.0, 1.0, -4.0, -127.0, 10.0]))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_absmax_is_exact(fmt):
    """The largest magnitude of every block maps to the format's maximum and comes back exactly."""
    x = sample("normal", 4 * 128, 5)
    y = roundtrip(x, fmt)
    for i in range(4):
        blk = slice(128 * i, 128 * (i + 1))
        j = x[blk].abs().argmax()
        assert torch.isclose(y[blk][j], x[blk][j], rtol=1e-6, atol=0)


# --- padding, zeros, layout ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_blocks_give_zeros(fmt):
    x = torch.zeros(300)
    x[200:210] = torch.linspace(-1, 1, 10)  # block 1 is not zero; blocks 0 and 2 are
    y = roundtrip(x, fmt)
    assert torch.isfinite(y).all()
    assert torch.equal(y[:128], torch.zeros(128)) and torch.equal(y[256:], torch.zeros(44))
    assert torch.equal(roundtrip(torch.zeros(5), fmt), torch.zeros(5))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_padding_does_not_change_values(fmt):
    """Quantizing a prefix gives the same values as the whole when blocks line up."""
    x = sample("normal", 3 * 128, 6)
    whole = roundtrip(x, fmt)
    part = roundtrip(x[: 2 * 128 + 5], fmt)
    assert torch.equal(part[:256], whole[:256])
    assert part.numel() == 261


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_block_formats_reject_non_finite(fmt):
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.tensor([1.0, float("nan")]), fmt)


def test_dequantize_from_unaligned_buffer():
    """A payload received into the middle of a larger buffer still decodes."""
    x = sample("normal", 200, 7)
    for fmt in FORMATS:
        packed = quantize(x, fmt)
        buffer = torch.cat([torch.zeros(1, dtype=torch.uint8), packed])
        assert torch.equal(dequantize(buffer[1:], fmt, 200), dequantize(packed, fmt, 200))


def test_input_validation():
    with pytest.raises(ValueError, match="unknown quantization format 'fp16'"):
        quantize(torch.zeros(4), "fp16")
    with pytest.raises(ValueError, match="1-D fp32"):
        quantize(torch.zeros(2, 2), "int8")
    with pytest.raises(ValueError, match="1-D fp32"):
        quantize(torch.zeros(4, dtype=torch.float64), "int8")
    with pytest.raises(ValueError, match="of 12 bytes"):
        dequantize(torch.zeros(11, dtype=torch.uint8), "int8", 8)
    with pytest.raises(ValueError, match="positive integer"):
        packed_nbytes(8, "int8", 0)


def test_quantize_does_not_alias_its_input():
    x = torch.ones(4)
    packed = quantize(x, "none")
    x.fill_(2.0)
    assert torch.equal(dequantize(packed, "none", 4), torch.ones(4))


# --- reduction ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_reduce_is_fp32_sum_of_dequantized(fmt):
    xs = [sample("normal", 333, 10 + i) for i in range(3)]
    packed = [quantize(x, fmt) for x in xs]
    total = reduce_quantized(packed, fmt, 333)
    want = torch.zeros(333)
    for p in packed:
        want += dequantize(p, fmt, 333)
    assert total.dtype == torch.float32 and torch.equal(total, want)
    if fmt == "none":
        assert torch.equal(total, xs[0] + xs[1] + xs[2])


def error_bound(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(x)) − x| (the bounds tested above)."""
    if fmt == "none":
        return torch.zeros_like(x)
    if fmt == "bf16":
        return x.abs() * 2.0**-8
    scale = block_scales(x, DEFAULT_BLOCK, QMAX[fmt])
    if fmt == "int8":
        return scale * 0.5 * (1 + 1e-5)
    if fmt == "fp4":
        return scale * (1 + 1e-5)
    return torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_two_group_mean_within_bound_and_unbiased(fmt, kind):
    """Averaging 2 groups' dequantized Δ stays within the mean of their bounds, and the
    rounding error averages out: over n values its mean is within 5 standard errors of 0,
    taking each error as uniform on [-bound, bound] (std bound / sqrt(3))."""
    n = 4096
    for trial in range(4):
        a, b = sample(kind, n, 100 + 2 * trial), sample(kind, n, 101 + 2 * trial)
        mean = reduce_quantized([quantize(a, fmt), quantize(b, fmt)], fmt, n) / 2
        exact = (a + b) / 2
        bound = (error_bound(a, fmt) + error_bound(b, fmt)) / 2
        err = mean - exact
        assert (err.abs() <= bound + 1e-12).all()
        if fmt != "none":
            standard_error = math.sqrt(bound.pow(2).mean().item() / 3 / n)
            assert abs(err.mean().item()) <= 5 * standard_error, (fmt, kind, trial)


@pytest.mark.parametrize("block", [DEFAULT_BLOCK, 7, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_chunk_by_chunk_gives_the_bits_of_the_whole_at_once(fmt, block, monkeypatch):
    """Encode and decode run a chunk of whole blocks at a time: chunks of 14 to 128 values (an odd
    count doubled, for fp4's pairs) give the bytes and sums of one chunk of everything."""
    xs = [sample("outliers", 1001, 30 + i) for i in range(3)]
    xs[0][:200] = 0.0  # all-zero blocks
    whole = [quantize(x, fmt, block) for x in xs]
    summed, decoded = reduce_quantized(whole, fmt, 1001, block), dequantize(whole[1], fmt, 1001, block)
    monkeypatch.setattr(quantize_module, "STEP_VALUES", 16)
    assert quantize_module._chunk(block) < 1001  # many chunks, the last one partial
    chunked = [quantize(x, fmt, block) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole))
    assert torch.equal(dequantize(whole[1], fmt, 1001, block).view(torch.int32), decoded.view(torch.int32))
    assert torch.equal(reduce_quantized(chunked, fmt, 1001, block).view(torch.int32), summed.view(torch.int32))
    if fmt in BLOCK_FORMATS:
        xs[2][900] = float("inf")  # in a late chunk: refused all the same
        with pytest.raises(ValueError, match="finite"):
            quantize(xs[2], fmt, block)


def test_reduce_is_deterministic():
    """Every group reduces the same gathered list in the same order, so all get the same bits."""
    xs = [sample("outliers", 1000, 20 + i) for i in range(4)]
    packed = [quantize(x, "fp4") for x in xs]
    first = reduce_quantized(packed, "fp4", 1000)
    again = reduce_quantized([p.clone() for p in packed], "fp4", 1000)
    assert torch.equal(first, again)
    assert math.isfinite(first.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_gpu_codec_gives_the_cpus_bits(fmt):
    """Groups agree on θ_g only if every codec device encodes and sums to the same bits."""
    torch.manual_seed(0)
    xs = [torch.randn(100_003) * 10.0 ** torch.randint(-6, 3, (100_003,)) for _ in range(3)]
    xs[0][:4096] = 0.0  # an all-zero block
    xs[1][5000:5100] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).repeat(15)[:100]  # fp4 ties
    on_cpu = [quantize(x, fmt) for x in xs]
    on_gpu = [quantize(x.cuda(), fmt).cpu() for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(on_cpu, on_gpu))
    summed_cpu = reduce_quantized(on_cpu, fmt, xs[0].numel())
    summed_gpu = reduce_quantized([p.cuda() for p in on_cpu], fmt, xs[0].numel()).cpu()
    assert torch.equal(summed_cpu.view(torch.int32), summed_gpu.view(torch.int32))
