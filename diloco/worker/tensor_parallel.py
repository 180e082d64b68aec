"""Tensor parallelism inside a replica group (Megatron-LM, Shoeybi et al. 2019) over DTensor.

Each block's attention splits its heads and its MLP its hidden units over the tp workers:
wq, wk, wv, w1 and w3 column-wise (each worker computes its own heads and units), wo and w2
row-wise (one all-reduce per sub-layer sums the partial outputs). The embedding table and the
output head are split by vocabulary, the logits gathered whole for the loss. Which dimension
of each weight is cut is ``diloco.train.tp_layout``'s table. The norms stay whole on every
worker as Replicate DTensors, so every parameter lives on one mesh and FSDP2 shards them all
over dp. A tied output head (``model.tie_embeddings``) stays tied: both layers cut the one
[vocab, dim] table by rows.

Sequence parallelism (Korthikanti et al. 2022, ``parallel.sequence_parallel``) also splits what
lies between the sub-layers: the residual stream and the norms' activations are cut along the
sequence over the tp workers, each row-wise all-reduce becomes a reduce-scatter to those
sequence shards and each sub-layer's input an all-gather of them. The same bytes travel; the
activations the norms and residual adds keep shrink tp-fold. Parameters are cut as without it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from diloco.train.model import RMSNorm, Transformer
from diloco.train.tp_layout import BLOCK_SHARD_DIMS

# Column-wise: the outputs (heads, hidden units) split, dim 0 of the weight; row-wise: the inputs, dim 1.
SEQUENCE = Shard(1)  # activations are [batch, seq, dim]


def block_plan(sequence_parallel: bool) -> dict:
    """The block's styles: each row-wise layer sums its partial outputs whole (an all-reduce) or,
    with sequence parallelism, scattered over the sequence (a reduce-scatter); then the norms run
    on sequence shards and each sub-layer gathers its whole input first (the rotary tables, the
    attention's other inputs, are whole already)."""
    between = SEQUENCE if sequence_parallel else Replicate()  # the residual stream's layout between sub-layers
    plan = {
        name: ColwiseParallel() if dim == 0 else RowwiseParallel(output_layouts=between)
        for name, dim in BLOCK_SHARD_DIMS.items()
    }
    if not sequence_parallel:
        return plan
    gathered = Replicate()
    return plan | {
        "attention_norm": SequenceParallel(),
        "ffn_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(SEQUENCE, None, None), desired_input_layouts=(gathered, None, None)
        ),
        "feed_forward": PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(gathered,)),
    }


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """Split ``model`` over the 1-D tp ``mesh`` in place; parameter names do not change."""
    tied = model.cfg.tie_embeddings
    between = SEQUENCE if sequence_parallel else Replicate()  # the residual stream's layout between sub-layers
    top_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top_plan["norm"] = SequenceParallel()
    # A pipeline stage holds the embedding only if it is the first, the norm and head only if the last.
    top_plan = {name: style for name, style in top_plan.items() if getattr(model, name) is not None}
    parallelize_module(model, mesh, top_plan)
    if tied:
        model.output.weight = model.tok_embeddings.weight  # the same rows, Shard(0), in both
    plan = block_plan(sequence_parallel)
    for block in model.layers.values():
        parallelize_module(block, mesh, plan)
    if sequence_parallel:
        return  # SequenceParallel made the norms' weights Replicate DTensors
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
