"""The payload codec a job's algo config chooses, and the sizes it reports."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diloco.config.algo import AlgoConfig
from diloco.outer.codecs import Dense, Quantized, Sparse, codec_for
from diloco.outer.quantize import FORMATS, packed_nbytes


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
