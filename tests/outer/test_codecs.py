"""The payload codec a job's algo config chooses, the sizes it reports, the dense sum's staging buffer, the non-finite check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diloco.config.algo import AlgoConfig
from diloco.outer.codecs import Dense, Quantized, Sparse, codec_for, launch_reduce
from diloco.outer.quantize import FORMATS, packed_nbytes
from diloco.outer.synchronizer import all_finite


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_quantize_format_chooses_the_dense_or_a_quantized_codec(fmt):
    codec = codec_for(dataclasses.replace(AlgoConfig(), quantize=fmt))
    assert isinstance(codec, Dense if fmt == "none" else Quantized)
    assert codec.nbytes(1000) == packed_nbytes(1000, fmt) and codec.error_buffer(1000) is None


def test_topk_chooses_the_sparse_codec_whose_e_starts_at_zero():
    algo = dataclasses.replace(AlgoConfig(), compress="topk", density=0.02, value_bits=2, error_decay=0.9)
    codec = codec_for(algo)
    assert isinstance(codec, Sparse) and codec.decay == 0.9 and codec.name == "top 2% in 2-bit values"
    assert codec.nbytes(5000) == codec.topk.nbytes(5000)
    assert torch.equal(codec.error_buffer(5000), torch.zeros(5000))


def test_the_dense_sum_runs_in_the_staging_buffer_it_was_given_and_in_a_new_one_without_room():
    class Lane:  # one member: the all-reduce leaves the buffer as it is
        def allreduce(self, tensors):
            self.buffer = tensors[0]
            return None

    staging = torch.zeros(6 + 3)
    delta = staging[:6]
    delta.copy_(torch.arange(6.0))
    lane = Lane()
    pending = launch_reduce(lane, delta, 2.0, Dense(), 1, extras=torch.tensor([5.0]), staging=staging)
    assert lane.buffer.data_ptr() == staging.data_ptr()
    assert torch.equal(pending.result(lambda work: None), torch.arange(6.0))  # 2·Δ summed, over Σw = 2
    assert torch.equal(pending.extras, torch.tensor([5.0]))
    cramped = torch.zeros(6)
    cramped.copy_(torch.arange(6.0))
    pending = launch_reduce(lane, cramped, 1.0, Dense(), 1, extras=torch.tensor([5.0]), staging=cramped)
    assert lane.buffer.data_ptr() != cramped.data_ptr() and lane.buffer.numel() == 8


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_finds_any_non_finite_entry_and_a_sum_that_overflowed_is_checked_entry_by_entry(bad):
    update = torch.ones(100)
    assert all_finite(update)
    update[37] = bad
    assert not all_finite(update)
    assert not all_finite(torch.tensor([float("inf"), -float("inf"), 1.0]))
    assert all_finite(torch.full((10,), 3e38))  # finite entries whose sum overflows
