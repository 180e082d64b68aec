"""Builds one worker's outer layer: fragments of its shard, θ_g copies, outer optimizers, manager."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from diloco.config.cluster import group_name
from diloco.config.job import JobConfig, training_config
from diloco.config.warmups import scheduled
from diloco.ft.client import LighthouseClient
from diloco.ft.fault_requests import FaultHook
from diloco.ft.lane_watch import LaneWatcher
from diloco.ft.lanes import Lanes
from diloco.ft.manager import Manager
from diloco.ft.state import HealState, counted_here, local_tensor
from diloco.outer.auto_overlap import AutoOverlap
from diloco.outer.bandwidth import bucket_for
from diloco.outer.ddp_sync import GradientSync
from diloco.outer.diloco_sync import Fragment, OuterSync
from diloco.outer.fragments import fragment_parameter_names
from diloco.outer.round_plan import FixedPlan
from diloco.outer.synchronizer import Synchronizer
from diloco.outer.update import global_copy
from diloco.worker.env import WorkerEnv
from outer_opt import MomentumWarmup, OuterOptConfig, build_outer_optimizer

HEARTBEATS_PER_TIMEOUT = 4


def build_fragments(
    job: JobConfig, outer_opt: OuterOptConfig, model: nn.Module, device: torch.device
) -> list[Fragment]:
    """Split this worker's shard of θ_l into P fragments, each with an fp32 CPU θ_g and an outer optimizer.

    A pipeline stage may hold no block of a fragment: it still takes part in that fragment's
    rounds (every stage of a group commits a round or none does) with an empty tensor in its place.
    """
    params = dict(model.named_parameters())
    names = fragment_parameter_names(list(params), job.model.n_layers, job.algo.fragments, job.algo.pattern)
    fragments = []
    for index, fragment_names in enumerate(names):
        local = [local_tensor(params[n]).detach() for n in fragment_names] or [torch.zeros(0, device=device)]
        owned = [counted_here(params[n]) for n in fragment_names] or [True]
        global_ = global_copy(local, pin_memory=device.type == "cuda")
        optimizer = build_outer_optimizer(global_, outer_opt)
        warmup_steps = outer_opt.momentum_warmup_steps
        warmup = MomentumWarmup(optimizer, warmup_steps) if warmup_steps else None
        fragments.append(
            Fragment(
                index=index, local=local, global_=global_, optimizer=optimizer, momentum_warmup=warmup, owned=owned
            )
        )
    return fragments


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
    group = group_name(job.group.id)
    timeouts = job.cluster.timeouts
    # Every rank watches its round (the lane it waits on is its own); only the leader heartbeats and asks.
    client = LighthouseClient(
        job.cluster.lighthouse.url(),
        token=job.cluster.lighthouse.token,
        job_id=job.name,
        signature=signature,
        group=group,
        connect_timeout_s=timeouts.connect,
        config=training_config(job) if env.rank == 0 else None,
    )
    manager = Manager(
        group=group,
        inner_pg=control_group(env, timeouts.control),
        client=client if env.rank == 0 else None,
        lanes=Lanes(local_rank=env.rank, connect_timeout_s=timeouts.connect, collective_timeout_s=timeouts.collective),
        quorum_timeout_s=timeouts.quorum,
        heartbeat_interval_s=timeouts.heartbeat / HEARTBEATS_PER_TIMEOUT,
        watch_rounds=job.algo.window == "time",
        lane_watch=LaneWatcher(client, poll_s=timeouts.quorum),
    )
    common = dict(
        manager=manager,
        collective_timeout_s=timeouts.collective,
        end_wait_s=timeouts.end + timeouts.quorum,
        commit_log=_commit_logger(commits_path) if env.rank == 0 else _ignore,
        faults=faults,
        bucket=bucket_for(job.cluster.lane_bandwidth_mbps),
    )
    if job.algo.name == "ddp":
        params = list(model.parameters())
        # θ is the live model itself: a healing group receives it directly, with no outer optimizer.
        heal_state = HealState(
            global_params=[[local_tensor(p).detach() for p in params]],
            outer_optimizers=[],
            inner_optimizer=inner_optimizer,
        )
        t = job.trainer
        tokens_per_step = t.batch_size * job.parallel.dp(env.world_size) * t.grad_accum * t.seq_len
        return GradientSync(params=params, tokens_per_step=tokens_per_step, heal_state=heal_state, **common)
    algo, outer_opt = scheduled(job)  # the warm-ups as this job runs them (diloco/config/warmups.py)
    fragments = build_fragments(job, outer_opt, model, device)
    auto = None
    if algo.auto:
        auto = AutoOverlap(algo, max(sum(g.numel() for g in f.global_) for f in fragments), device)
    heal_state = HealState(
        global_params=[f.global_ for f in fragments],
        outer_optimizers=[f.optimizer for f in fragments],
        inner_optimizer=inner_optimizer,
        extra={} if auto is None else {"auto.plan": auto.plan},
    )
    plan = auto or FixedPlan(algo, device)
    return OuterSync(algo=algo, fragments=fragments, plan=plan, heal_state=heal_state, **common)


def control_group(env: WorkerEnv, timeout_s: float) -> dist.ProcessGroup | None:
    """The group's own Gloo group for the manager's small messages (quorum, commit votes).

    Separate from FSDP's group because an outer round runs on a background thread while
    the training thread's FSDP collectives go on: two threads must never share one group.
    Every rank creates it at the same point (here), as ``new_group`` requires.
    """
    if env.world_size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _commit_logger(path: Path) -> Callable[[dict], None]:
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(record: dict) -> None:
        with path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")

    return write


def _ignore(record: dict) -> None:
    return None
