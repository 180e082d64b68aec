"""Tensor parallelism inside a group against the plain run: real worker processes, Gloo, DTensor, FSDP2.

Tolerance: 1e-6 absolute on every weight after 20 inner steps and two outer rounds (measured
1.5e-7): tp workers sum partial products in another order than one worker does.
"""

from __future__ import annotations

import pytest
import torch

from diloco.launch.inference import locate_weights, read_weights
from diloco.train.checkpoint import step_dir
from tests.layouts import assert_close, assert_same_norms, trained

pytestmark = pytest.mark.slow

TOLERANCE = 1e-6
DP2_TP2_SP = ("cluster.workers_per_group=4", "parallel.tp=2", "parallel.sequence_parallel=true")


def run(fast_job, tmp_path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    return trained(fast_job("trainer.checkpoint.every=20", *overrides), tmp_path / name)


def test_tp2_equals_one_worker_and_dp2_x_tp2_sequence_parallel_equals_fsdp2_with_a_tied_head(fast_job, tmp_path):
    """dp 2 x tp 2 reads the same batches as FSDP over 2 workers (data is split over dp only);
    sequence parallelism moves activations, never what is computed."""
    tied = "model.tie_embeddings=true"
    one = run(fast_job, tmp_path, "one", "cluster.workers_per_group=1", tied)
    tp2 = run(fast_job, tmp_path, "tp2", "cluster.workers_per_group=2", "parallel.tp=2", tied)
    assert_close(tp2, one, TOLERANCE)
    fsdp2 = run(fast_job, tmp_path, "fsdp2", "cluster.workers_per_group=2")
    dp2_tp2 = run(fast_job, tmp_path, "dp2_tp2", *DP2_TP2_SP)
    assert_close(dp2_tp2, fsdp2, TOLERANCE)
    assert_same_norms(tmp_path / "tp2", tmp_path / "one")  # tensor parallelism's replicated norms counted once
    assert_same_norms(tmp_path / "dp2_tp2", tmp_path / "fsdp2")
    # role=eval from a checkpoint: the 4 workers' shards of θ_g joined by the tensor-parallel layout
    job = fast_job(*DP2_TP2_SP)
    weights, _ = locate_weights(str(step_dir(tmp_path / "dp2_tp2", 20)))  # role=eval checkpoint=...
    joined = read_weights(weights, job)
    assert all(torch.equal(joined[k], dp2_tp2[k]) for k in dp2_tp2)
