"""A replica group's own process group, its dp x tp mesh, tensor parallelism and FSDP2 sharding
(NCCL on CUDA, Gloo on CPU)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from diloco.train.model import Transformer
from diloco.worker.env import WorkerEnv
from diloco.worker.tensor_parallel import apply_tensor_parallel


def init_group(
    env: WorkerEnv, device: torch.device, *, tp: int, connect_timeout_s: float, collective_timeout_s: float
) -> DeviceMesh:
    """Join the group's default process group and return its device mesh: 1-D ("shard") without
    tensor parallelism, else ("shard", "tp") with rank = dp index x tp + tp index.

    The store gets the connect timeout (how long to wait for peers to appear), the process
    group the collective timeout (how long one all-reduce may take), so neither wait is unbounded.
    On CUDA, CPU tensors still get Gloo, so small bookkeeping collectives work on either device.
    """
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=env.rank == 0 and not env.agent_hosts_store,
        timeout=timedelta(seconds=connect_timeout_s),
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
    if tp == 1:
        return init_device_mesh(device.type, (env.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (env.world_size // tp, tp), mesh_dim_names=("shard", "tp"))


def shard_model(model: Transformer, mesh: DeviceMesh, device: torch.device, *, sequence_parallel: bool = False) -> bool:
    """Tensor parallelism over the mesh's tp dimension (if it has one), then FSDP2 ``fully_shard``
    each transformer block and the root over its dp ("shard") dimension; a group of one stays whole.

    Returns whether FSDP2 sharded the model. On CUDA parameters are gathered in bf16 and
    gradients reduced in fp32, which matches the bf16 autocast of the forward pass.
    """
    if "tp" in (mesh.mesh_dim_names or ()):
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
        mesh = mesh["shard"]
    if mesh.size() == 1:
        return False
    policy = MixedPrecisionPolicy()
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return True
