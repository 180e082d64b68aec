"""Tensor parallelism inside a group against the plain run: real worker processes, Gloo, DTensor, FSDP2.

Tolerance: 5e-6 absolute on every weight after 20 inner steps and two outer rounds (measured
1.5e-7 on one machine, 1.22e-6 on another, whose CPU's matmul kernels sum in another order): tp
workers sum partial products in another order than one worker does.
"""

from __future__ import annotations

import pytest
import torch

from diloco.launch.inference import locate_weights, read_weights
from diloco.train.checkpoint import step_dir
from tests.layouts import assert_close, assert_same_norms, trained

pytestmark = pytest.mark.slow

TOLERANCE = 5e-6
MUON_TOLERANCE = 1e-5  # see test_muon_under_fsdp2_and_under_tp2_equals_one_worker
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


def test_muon_under_fsdp2_and_under_tp2_equals_one_worker(fast_job, tmp_path):
    """inner_opt=muon orthogonalizes each sharded matrix whole (gathered, then each worker keeps its
    shard): FSDP2 over 2 workers on half batches and tp 2 equal one worker on the whole batch.
    Tolerance 1e-5 (measured 3.6e-6 for FSDP2, 2.2e-6 for tp 2, at lr 0.02, 4x the preset's): the
    gradients' rounding differences (another summation order) reach the weights through an update of
    fixed RMS 0.2·lr, so they grow with lr (at lr 3e-3: 3.6e-7 and 2.6e-7, within AdamW's 1e-6)."""
    muon = ("inner_opt=muon", "inner_opt.lr=0.02")
    one = run(fast_job, tmp_path, "one", *muon, "cluster.workers_per_group=1", "trainer.batch_size=8")
    fsdp2 = run(fast_job, tmp_path, "fsdp2", *muon, "cluster.workers_per_group=2", "trainer.batch_size=4")
    assert_close(fsdp2, one, MUON_TOLERANCE)
    tp2 = run(fast_job, tmp_path, "tp2", *muon, "cluster.workers_per_group=2", "parallel.tp=2")
    assert_close(tp2, one, MUON_TOLERANCE)
