"""A job's outer layer for one worker: the job's config turned into the library's parts (diloco/library/build.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from diloco.config.job import JobConfig, training_config
from diloco.ft.fault_requests import FaultHook
from diloco.ft.state import HealState, local_tensor
from diloco.library.build import (
    Membership,
    OuterSettings,
    build_manager,
    synchronizer_parts,
)
from diloco.library.build import (
    build_outer_sync as build_diloco_sync,
)
from diloco.outer.ddp_sync import GradientSync
from diloco.outer.synchronizer import Synchronizer
from diloco.worker.env import WorkerEnv


def outer_settings(job: JobConfig) -> OuterSettings:
    """The outer rounds as ``job`` configures them."""
    return OuterSettings(
        algo=job.algo,
        max_steps=job.trainer.max_steps,
        outer_opt=job.outer_opt,
        timeouts=job.cluster.timeouts,
        warmup_share=job.trainer.warmup_share,
        n_blocks=job.model.n_layers,
        lane_bandwidth_mbps=job.cluster.lane_bandwidth_mbps,
    )


def membership(job: JobConfig, env: WorkerEnv, signature: str) -> Membership:
    """This worker's place in ``job``: its group, its rank, the lighthouse its config names."""
    lighthouse = job.cluster.lighthouse
    return Membership(
        lighthouse=lighthouse.url(),
        job=job.name,
        group=job.group.id,
        signature=signature,
        token=lighthouse.token,
        rank=env.rank,
        world_size=env.world_size,
        config=training_config(job) if env.rank == 0 else None,
    )


def build_outer_sync(
    job: JobConfig,
    env: WorkerEnv,
    *,
    model: nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    signature: str,
    device: torch.device,
    commits_path: Path,
    faults: FaultHook | None = None,
) -> Synchronizer:
    """Everything the trainer needs to take part in outer rounds; the leader also talks to the lighthouse.

    Not started: ``start()`` it before the first round and ``close()`` it at the end.
    """
    member = membership(job, env, signature)
    commit_log = commits_path if member.leader else None
    if job.algo.name != "ddp":
        return build_diloco_sync(
            outer_settings(job),
            member,
            model=model,
            inner_optimizer=inner_optimizer,
            device=device,
            commit_log=commit_log,
            faults=faults,
        )
    timeouts = job.cluster.timeouts
    parts = synchronizer_parts(
        build_manager(member, timeouts),
        timeouts,
        lane_bandwidth_mbps=job.cluster.lane_bandwidth_mbps,
        commit_log=commit_log,
        faults=faults,
    )
    params = list(model.parameters())
    # θ is the live model itself: a healing group receives it directly, with no outer optimizer.
    heal_state = HealState(
        global_params=[[local_tensor(p).detach() for p in params]],
        outer_optimizers=[],
        inner_optimizer=inner_optimizer,
    )
    t = job.trainer
    tokens_per_step = t.batch_size * job.parallel.dp(env.world_size) * t.grad_accum * t.seq_len
    return GradientSync(params=params, tokens_per_step=tokens_per_step, heal_state=heal_state, **parts)
