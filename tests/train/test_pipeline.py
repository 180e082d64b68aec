"""Pipeline stages cut out of the whole model: which blocks each holds, under which names, and that
running them in turn is the whole model's forward (no process group needed)."""

from __future__ import annotations

import dataclasses

import torch

from diloco.config.model import ModelConfig
from diloco.config.parallel import ParallelConfig
from diloco.train.model import Transformer
from diloco.train.pipeline import split_for_worker, stage_blocks, stage_parameter_names, worker_stages

SIX_BLOCKS = dataclasses.replace(ModelConfig(), n_layers=6)


def test_stages_take_blocks_evenly_or_as_split_and_workers_loop_over_them():
    assert stage_blocks(ParallelConfig(pp=4), 6) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert stage_blocks(ParallelConfig(pp=2, pp_split=(5, 1)), 6) == [range(0, 5), range(5, 6)]
    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")
    assert [worker_stages(interleaved, i) for i in range(2)] == [[0, 2], [1, 3]]
    assert worker_stages(ParallelConfig(pp=3), 2) == [2]


def test_the_mesh_puts_pipeline_positions_outermost_and_tensor_parallel_innermost():
    parallel = ParallelConfig(pp=2, tp=2)  # 8 workers: pp 2 x dp 2 x tp 2
    assert parallel.mesh_shape(8) == ((2, 2, 2), ("pp", "shard", "tp"))
    assert [parallel.pp_index(r, 8) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [parallel.dp_index(r, 8) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ParallelConfig().mesh_shape(2) == ((2,), ("shard",))
    assert ParallelConfig(pp=2).mesh_shape(2) == ((2, 1), ("pp", "shard"))


def test_stages_keep_the_whole_models_names_and_run_as_the_whole_model():
    torch.manual_seed(0)
    whole = Transformer(SIX_BLOCKS)
    parallel = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_split=(1, 2, 2, 1))
    workers = [split_for_worker(whole, parallel, i) for i in range(2)]
    names = {name: p for name, p in whole.named_parameters()}
    held = [dict(w.named_parameters()) for w in workers]
    assert sorted(held[0]) == sorted(stage_parameter_names(SIX_BLOCKS, parallel, 0))
    assert held[0].keys().isdisjoint(held[1]) and held[0].keys() | held[1].keys() == names.keys()
    assert all(held[i][n] is names[n] for i in range(2) for n in held[i]), "stages share the whole model's tensors"
    assert "tok_embeddings.weight" in held[0] and "output.weight" in held[1] and "layers.3.ffn_norm.weight" in held[0]
    tokens = torch.randint(0, SIX_BLOCKS.vocab_size, (2, 16))
    h = tokens
    for stage in (0, 1, 2, 3):  # stage s runs on worker s % 2, as its (s // 2)-th chunk
        h = workers[stage % 2].chunks[stage // 2](h)
    assert torch.equal(h, whole(tokens))
