"""Tensor parallelism inside a replica group (Megatron-LM, Shoeybi et al. 2019) over DTensor.

Each block's attention splits its heads and its MLP its hidden units over the tp workers:
wq, wk, wv, w1 and w3 column-wise (each worker computes its own heads and units), wo and w2
row-wise (one all-reduce per sub-layer sums the partial outputs). The embedding table and the
output head are split by vocabulary, the logits gathered whole for the loss. Which dimension
of each weight is cut is ``diloco.train.tp_layout``'s table. The norms stay whole on every
worker as Replicate DTensors, so every parameter lives on one mesh and FSDP2 shards them all
over dp. A tied output head (``model.tie_embeddings``) stays tied: both layers cut the one
[vocab, dim] table by rows.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from diloco.train.model import RMSNorm, Transformer
from diloco.train.tp_layout import BLOCK_SHARD_DIMS

# Column-wise: the outputs (heads, hidden units) split, dim 0 of the weight; row-wise: the inputs, dim 1.
BLOCK_PLAN = {name: ColwiseParallel() if dim == 0 else RowwiseParallel() for name, dim in BLOCK_SHARD_DIMS.items()}


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh) -> None:
    """Split ``model`` over the 1-D tp ``mesh`` in place; parameter names do not change."""
    tied = model.cfg.tie_embeddings
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if tied:
        model.output.weight = model.tok_embeddings.weight  # the same rows, Shard(0), in both
    for block in model.layers:
        parallelize_module(block, mesh, BLOCK_PLAN)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            distribute_module(module, mesh, _replicate, input_fn=_whole_input, output_fn=_local_output)


def _replicate(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()])))


def _whole_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """A norm's input is the whole activation on every tp worker (after a row-wise all-reduce)."""
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local()
