"""algo.compress=topk through the real outer loop: real lighthouse, real Gloo lanes, groups as threads.

The exactness knob at the identity (density 1, 32-bit values, β = 0) is plain DiLoCo; a
compressed job ends with one digest while each group keeps its own e (docs/design.md, invariants 1, 9 and 10).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose_job
from tests.outer.test_outer import BASE, _groups_mock, _two_group_trainers

COMMON = BASE + ["cluster.groups=2", "algo.sync_every=4", "trainer.max_steps=8", "trainer.seq_len=32", "algo.alpha=0"]
IDENTITY = ["algo.compress=topk", "algo.density=1", "algo.value_bits=32", "algo.error_decay=0"]


@pytest.mark.slow  # a lighthouse and its groups' rounds (~1-2 s)
@pytest.mark.parametrize(
    "algo",
    [["algo=diloco"], ["algo=streaming", "algo.fragments=2", "algo.delay=1", "algo.quantize=none"]],
    ids=["diloco", "streaming-P2-tau1"],
)
def test_topk_at_density_1_with_32_bit_values_and_no_feedback_is_the_uncompressed_run(tmp_path, algo):
    """Equal bit for bit at M = 2: each group's Δ decodes exactly and Σ w·Δ adds the same two terms
    (stated tolerance, should the sum order ever differ: 1e-6 absolute)."""
    plain = _two_group_trainers(compose_job(COMMON + algo), tmp_path / "plain")
    sparse = _two_group_trainers(compose_job(COMMON + algo + IDENTITY), tmp_path / "sparse")
    for a, b in zip(plain[0].model.parameters(), sparse[0].model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert plain[0].outer.group_digest() == sparse[0].outer.group_digest() == sparse[1].outer.group_digest()
    assert sparse[0].outer.bytes_sent > 0
    assert all(not f.error.any() for t in sparse for f in t.outer.fragments), "nothing is left behind at density 1"


def test_a_compressed_job_ends_with_one_digest_and_each_group_keeps_its_own_error(tmp_path):
    job = compose_job(
        BASE
        + ["cluster.groups=2", "algo.sync_every=5", "trainer.max_steps=10", "outer_opt=sgd", "outer_opt.lr=1"]
        + ["outer_opt.momentum=0", "algo.alpha=0", "algo.compress=topk", "algo.density=0.05"]
    )
    _, outers, _ = _groups_mock(job, tmp_path, scales=(1.0, 3.0), steps=10)
    errors = [outers[g].fragments[0].error for g in range(2)]
    assert errors[0].any() and not torch.equal(errors[0], errors[1]), "e is each group's own residual"
    digest = outers[0].group_digest()
    assert outers[1].group_digest() == digest
    errors[0].add_(1.0)
    assert outers[0].fresh_digest() == digest, "e is not in the digest (invariant 10)"
    payload = outers[0].plan.codec.nbytes(errors[0].numel())
    assert outers[0].bytes_sent == 2 * (payload + 4), "two rounds, each one payload and its weight to the one peer"


def test_e_is_checkpointed_restored_and_zeroed_by_a_heal(tmp_path):
    job = compose_job(
        BASE
        + ["cluster.groups=2", "algo.sync_every=5", "trainer.max_steps=5", "algo.alpha=0"]
        + ["algo.compress=topk", "algo.density=0.1", "algo.value_bits=4"]
    )
    _, outers, _ = _groups_mock(job, tmp_path, scales=(1.0, 3.0), steps=5)
    outer = outers[0]
    saved = {k: v.clone() for k, v in outer.checkpoint_tensors().items()}
    assert saved["error.0"].any()
    assert "error.0" not in outer.heal_state.tensors(), "a heal never sends e"
    outer.fragments[0].error.zero_()
    outer.load_checkpoint_tensors(saved)
    assert torch.equal(outer.fragments[0].error, saved["error.0"])
    outer._after_heal()
    assert not outer.fragments[0].error.any(), "a healed group starts with e = 0"
