"""``algo.compress=topk``'s keys: each bad value refused in one line naming the key, the value and the fix."""

from __future__ import annotations

import pytest

from diloco.config.base import ConfigError
from tests.conftest import compose_job

TOPK = ["algo=diloco", "algo.compress=topk"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (TOPK + ["algo.density=0"], r"^algo\.density=0(\.0)?: must be in \(0, 1\]"),
        (TOPK + ["algo.density=1.5"], r"^algo\.density=1\.5: must be in \(0, 1\]"),
        (TOPK + ["algo.value_bits=3"], r"^algo\.value_bits=3: must be one of 1, 2, 4, 8, 32"),
        (TOPK + ["algo.error_decay=1.2"], r"^algo\.error_decay=1\.2: must be in \[0, 1\]"),
        (TOPK + ["algo.sparse_reference_groups=-1"], r"^algo\.sparse_reference_groups=-1: must be an integer >= 0"),
        (
            TOPK + ["algo.quantize=fp4"],
            r"^algo\.quantize='fp4': cannot be combined with algo\.compress=topk.*use algo\.quantize=none",
        ),
        (["algo=ddp", "algo.compress=topk"], r"^algo\.compress='topk' does nothing with algo=ddp, .*use algo=diloco"),
        (["algo=local", "algo.compress=topk"], r"^algo\.compress='topk' does nothing with algo=local"),
        (["algo=ddp", "algo.density=0.01"], r"^algo\.density=0\.01 does nothing with algo=ddp"),
    ],
)
def test_a_bad_compression_setting_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        compose_job(overrides)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 32])
def test_every_offered_setting_passes_with_diloco_and_streaming(bits):
    for algo in (["algo=diloco"], ["algo=streaming", "algo.quantize=none"]):
        job = compose_job(algo + ["algo.compress=topk", "algo.density=1", f"algo.value_bits={bits}"])
        assert (job.algo.compress, job.algo.value_bits) == ("topk", bits)
