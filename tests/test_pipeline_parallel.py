"""Pipeline parallelism inside a group against the plain run: real worker processes, Gloo,
torch.distributed.pipelining, with FSDP2 and tensor parallelism beside it.

Tolerance: 1e-6 absolute on every weight after 20 inner steps and two outer rounds of each
fragment (measured 1.2e-7 to 2.7e-7): microbatches sum their gradients in another order than one
pass over the batch does. Streaming with sequential fragments puts each fragment on one stage, so
every worker also takes part in rounds of a fragment it holds nothing of.
"""

from __future__ import annotations

import pytest
import torch

from diloco.launch.inference import locate_weights, read_weights
from diloco.train.checkpoint import step_dir
from tests.layouts import assert_close, assert_same_norms, trained

pytestmark = pytest.mark.slow

TOLERANCE = 1e-6
STREAMING = ("algo=streaming", "algo.fragments=2", "algo.pattern=sequential", "algo.delay=1", "algo.quantize=none")
FOUR_BLOCKS = ("model.n_layers=4", "trainer.checkpoint.every=20", *STREAMING)
PP2_DP2 = ("cluster.workers_per_group=4", "parallel.pp=2", "parallel.pp_schedule=1f1b")


def run(fast_job, tmp_path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    return trained(fast_job(*FOUR_BLOCKS, *overrides), tmp_path / name)


def test_every_schedule_equals_the_run_without_stages(fast_job, tmp_path):
    """GPipe over 2 workers and interleaved 1F1B (2 stages each) beside tp 2 read what one worker
    reads; pp 2 x dp 2 with 1F1B reads what FSDP over 2 workers reads (data splits over dp only)."""
    one = run(fast_job, tmp_path, "one", "cluster.workers_per_group=1")
    gpipe = run(
        fast_job, tmp_path, "gpipe", "cluster.workers_per_group=2", "parallel.pp=2", "parallel.pp_schedule=gpipe"
    )
    assert_close(gpipe, one, TOLERANCE)
    interleaved = (
        "cluster.workers_per_group=4",
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.pp_schedule=interleaved_1f1b",
    )
    assert_close(run(fast_job, tmp_path, "interleaved_tp2", *interleaved), one, TOLERANCE)
    fsdp2 = run(fast_job, tmp_path, "fsdp2", "cluster.workers_per_group=2")
    pp2_dp2 = run(fast_job, tmp_path, "pp2_dp2", *PP2_DP2)
    assert_close(pp2_dp2, fsdp2, TOLERANCE)
    for layout, reference in (("gpipe", "one"), ("interleaved_tp2", "one"), ("pp2_dp2", "fsdp2")):
        assert_same_norms(tmp_path / layout, tmp_path / reference)  # each entry counted once, whatever its stage
    # role=eval from a checkpoint: each pipeline position's shards of θ_g joined, the positions put together
    weights, _ = locate_weights(str(step_dir(tmp_path / "pp2_dp2", 20)))
    joined = read_weights(weights, fast_job(*FOUR_BLOCKS, *PP2_DP2))
    assert joined.keys() == pp2_dp2.keys() and all(torch.equal(joined[k], pp2_dp2[k]) for k in pp2_dp2)
