"""The tensor-parallel layout: which dimension each weight is cut along, and joining shards back."""

from __future__ import annotations

import pytest
import torch

from diloco.config.job import training_config
from diloco.train.model import Transformer
from diloco.train.tp_layout import join_shards, tp_shard_dim
from tests.conftest import compose_job


def test_every_weight_of_the_model_has_its_cut():
    model = Transformer(compose_job(["model=tiny"]).model)
    cuts = {name: tp_shard_dim(name) for name, _ in model.named_parameters()}
    assert cuts["tok_embeddings.weight"] == 0 and cuts["output.weight"] == 0
    assert cuts["layers.1.attention.wk.weight"] == 0 and cuts["layers.1.feed_forward.w3.weight"] == 0
    assert cuts["layers.0.attention.wo.weight"] == 1 and cuts["layers.0.feed_forward.w2.weight"] == 1
    assert cuts["layers.0.attention_norm.weight"] is None and cuts["norm.weight"] is None


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (3, 1), (1, 2), (2, 2), (2, 4)])
@pytest.mark.parametrize("dim", [0, 1, None])
def test_shards_cut_as_fsdp2_over_tensor_parallelism_join_back_whole(dp, tp, dim):
    """Rank d x tp + t holds FSDP2's d-th run of dim 0 of the t-th tensor-parallel piece."""
    whole = torch.arange(8 * 12).reshape(8, 12).float()
    pieces = [whole] * tp if dim is None else list(torch.chunk(whole, tp, dim=dim))
    shards = [None] * (dp * tp)
    for t, piece in enumerate(pieces):
        for d, run in enumerate(torch.chunk(piece, dp, dim=0)):
            shards[d * tp + t] = run
    assert torch.equal(join_shards(shards, dim, tp), whole)


def test_groups_of_different_meshes_disagree_on_the_shared_configuration():
    """The lighthouse refuses a group whose training configuration differs, naming the keys."""
    one, two = (training_config(compose_job([f"parallel.tp={tp}"])) for tp in (1, 2))
    assert {k for k in one if one[k] != two[k]} == {"parallel.tp"}
