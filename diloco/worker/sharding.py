"""A replica group's own process group, its pp x dp x tp mesh, tensor parallelism and FSDP2 sharding
(NCCL on CUDA, Gloo on CPU)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from diloco.config.parallel import ParallelConfig
from diloco.library.group import group_store
from diloco.train.pipeline import StageChunks
from diloco.worker.env import WorkerEnv
from diloco.worker.tensor_parallel import apply_tensor_parallel


def init_group(
    env: WorkerEnv,
    device: torch.device,
    *,
    parallel: ParallelConfig,
    connect_timeout_s: float,
    collective_timeout_s: float,
) -> DeviceMesh:
    """Join the group's default process group and return its device mesh: ("shard",) alone, or with
    "pp" before it and "tp" after it where those degrees exceed 1 (``ParallelConfig.mesh_shape``).

    The store gets the connect timeout (how long to wait for peers to appear), the process
    group the collective timeout (how long one all-reduce may take), so neither wait is unbounded.
    On CUDA, CPU tensors still get Gloo, so small bookkeeping collectives work on either device.

    Under torchrun each restart of the group rendezvous under a prefix of its own
    (``diloco.library.group``).
    """
    store = group_store(
        env.master_addr,
        env.master_port,
        env.world_size,
        env.rank,
        agent_hosts_store=env.agent_hosts_store,
        restart_count=env.restart_count,
        connect_timeout_s=connect_timeout_s,
    )
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=collective_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    shape, names = parallel.mesh_shape(env.world_size)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def shard_model(model: nn.Module, mesh: DeviceMesh, device: torch.device, *, sequence_parallel: bool = False) -> bool:
    """Tensor parallelism over the mesh's tp dimension (if it has one), then FSDP2 ``fully_shard``
    each transformer block and the root over its dp ("shard") dimension; a group of one stays whole.
    A pipeline stage's worker shards each of its stages so (``StageChunks``: each is a root).

    Returns whether FSDP2 sharded the model. On CUDA parameters are gathered in bf16 and
    gradients reduced in fp32, which matches the bf16 autocast of the forward pass.
    """
    names = mesh.mesh_dim_names or ()
    roots = list(model.chunks) if isinstance(model, StageChunks) else [model]
    if "tp" in names:
        for root in roots:
            apply_tensor_parallel(root, mesh["tp"], sequence_parallel=sequence_parallel)
    dp_mesh = mesh["shard"] if len(names) > 1 else mesh
    if dp_mesh.size() == 1:
        return False
    policy = MixedPrecisionPolicy()
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for root in roots:
        for block in root.layers.values():
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(root, mesh=dp_mesh, mp_policy=policy)
    return True
