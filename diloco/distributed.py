"""A replica group's own process group and FSDP2 sharding (NCCL on CUDA, Gloo on CPU)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from diloco.config_base import check

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class WorkerEnv:
    """Where one worker sits in its replica group: torchrun's variables, read once at an entry point."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_hosts_store: bool = False  # torchrun's agent already serves the store at MASTER_PORT

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> WorkerEnv:
        missing = [k for k in TORCHRUN_KEYS if k not in environ]
        if missing:
            raise RuntimeError(
                f"missing {', '.join(missing)} in the environment: role=group runs one worker of a "
                "replica group and expects torchrun's variables (torchrun --nproc-per-node N run.py role=group ...)"
            )
        return cls(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
            agent_hosts_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        )

    def to_environ(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def check_device(preference: str) -> None:
    """Refuse ``cluster.device=cuda`` where torch sees no GPU, before any process starts."""
    check(
        preference != "cuda" or torch.cuda.is_available(),
        "cluster.device",
        preference,
        "torch sees no CUDA device on this machine; use cluster.device=cpu (or auto)",
    )


def select_device(preference: str, local_rank: int) -> torch.device:
    """``auto`` takes this worker's GPU when there is one, else the CPU."""
    check_device(preference)
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_group(
    env: WorkerEnv, device: torch.device, *, connect_timeout_s: float, collective_timeout_s: float
) -> DeviceMesh:
    """Join the group's default process group and return its 1-D device mesh.

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
    return init_device_mesh(device.type, (env.world_size,), mesh_dim_names=("shard",))


def shard_model(model: nn.Module, blocks: nn.ModuleList, mesh: DeviceMesh, device: torch.device) -> bool:
    """FSDP2 ``fully_shard`` each transformer block, then the root; a one-worker group stays whole.

    Returns whether the model was sharded. On CUDA parameters are gathered in bf16 and
    gradients reduced in fp32, which matches the bf16 autocast of the forward pass.
    """
    if mesh.size() == 1:
        return False
    policy = MixedPrecisionPolicy()
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return True
