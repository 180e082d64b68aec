"""Which dimension of each parameter tensor parallelism splits, and how workers' shards join again.

The one table both sides read: ``diloco.worker.tensor_parallel`` splits the model by it and
``role=eval``/``role=sample`` put a checkpoint's per-worker shards back together by it. A
[out, in] Linear split column-wise (its outputs: heads, hidden units) is cut along dim 0,
row-wise (its inputs) along dim 1; the embedding table is cut by vocabulary rows (dim 0) and
so is the output head. Norm weights are whole on every worker (None).
"""

from __future__ import annotations

import torch

BLOCK_SHARD_DIMS = {
    "attention.wq": 0,
    "attention.wk": 0,
    "attention.wv": 0,
    "attention.wo": 1,
    "feed_forward.w1": 0,
    "feed_forward.w3": 0,
    "feed_forward.w2": 1,
}
TOP_SHARD_DIMS = {"tok_embeddings": 0, "output": 0}


def tp_shard_dim(name: str) -> int | None:
    """The dimension tensor parallelism cuts parameter ``name`` along (None: whole on every worker)."""
    module = name.removesuffix(".weight")
    if module in TOP_SHARD_DIMS:
        return TOP_SHARD_DIMS[module]
    parts = module.split(".")
    if len(parts) == 4 and parts[0] == "layers":
        return BLOCK_SHARD_DIMS.get(".".join(parts[2:]))
    return None


def join_shards(shards: list[torch.Tensor], dim: int | None, tp: int) -> torch.Tensor:
    """The whole tensor from every worker's shard in rank order (rank = dp index x tp + tp index).

    FSDP2 cuts each worker's tensor-parallel piece along dim 0 over the dp workers, so each
    piece is first joined along dim 0, then the tp pieces along ``dim``.
    """
    dp = len(shards) // tp
    pieces = [torch.cat([shards[d * tp + t] for d in range(dp)], dim=0) for t in range(tp)]
    return pieces[0] if dim is None else torch.cat(pieces, dim=dim)
