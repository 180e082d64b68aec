"""The outer machinery from plain parts: what a job's worker and a user's own loop both build.

One replica group's process joins a job through its lighthouse (``Membership``) and syncs its
model's θ every H inner steps (``OuterSettings``): ``build_outer_sync`` splits the model into
Streaming DiLoCo's P fragments, gives each an fp32 θ_g copy and an outer optimizer, and wires the
manager that asks the lighthouse for quorums and all-reduces Δ between groups. Nothing here reads
a ``JobConfig``: ``diloco/worker/outer_builder.py`` turns the job into these parts, ``DiLoCo``
(``diloco/library/loop.py``) a user's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.config.algo import AlgoConfig
from diloco.config.cluster import TimeoutsConfig, group_name
from diloco.config.warmups import cut_warmups
from diloco.ft.client import LighthouseClient
from diloco.ft.fault_requests import FaultHook
from diloco.ft.lane_watch import LaneWatcher
from diloco.ft.lanes import Lanes
from diloco.ft.manager import Manager
from diloco.ft.reach import ReachProbes
from diloco.ft.state import HealState, counted_here, local_tensor
from diloco.outer.auto_overlap import AutoOverlap
from diloco.outer.bandwidth import bucket_for
from diloco.outer.diloco_sync import Fragment, OuterSync
from diloco.outer.fragments import count_blocks, fragment_parameter_names
from diloco.outer.round_plan import FixedPlan
from diloco.outer.update import global_copy
from outer_opt import OuterOptConfig, build_outer_optimizer

HEARTBEATS_PER_TIMEOUT = 4


@dataclass(frozen=True)
class Membership:
    """Who this process is in the job: the lighthouse it asks, the job and group it belongs to,
    its rank among its group's ``world_size`` workers, and the ``signature`` of the model every
    group must present (``config``: what the lighthouse compares across groups besides)."""

    lighthouse: str
    job: str
    group: int
    signature: str
    token: str = field(default="", repr=False)
    rank: int = 0
    world_size: int = 1
    config: dict[str, Any] | None = None

    @property
    def leader(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class OuterSettings:
    """How the outer rounds run: ``algo``'s H, P, τ, α and payload, ``outer_opt``'s update, every
    wait's bound, and the job's length (the warm-ups are cut to ``warmup_share`` of ``max_steps``)."""

    algo: AlgoConfig
    max_steps: int
    outer_opt: OuterOptConfig = field(default_factory=OuterOptConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    warmup_share: float = 0.2
    n_blocks: int | None = None  # the model's transformer blocks; None: counted from its parameter names
    lane_bandwidth_mbps: float = 0.0  # caps each worker's outer traffic (0: no cap)


def build_manager(member: Membership, timeouts: TimeoutsConfig, *, watch_rounds: bool = False) -> Manager:
    """The group's side of the fault-tolerance layer: every rank watches its round (the lane it waits
    on is its own); only the leader heartbeats and asks the lighthouse for quorums."""
    client = LighthouseClient(
        member.lighthouse,
        token=member.token,
        job_id=member.job,
        signature=member.signature,
        group=group_name(member.group),
        connect_timeout_s=timeouts.connect,
        config=member.config if member.leader else None,
    )
    return Manager(
        group=group_name(member.group),
        inner_pg=control_group(member.world_size, timeouts.control),
        client=client if member.leader else None,
        lanes=Lanes(
            local_rank=member.rank, connect_timeout_s=timeouts.connect, collective_timeout_s=timeouts.collective
        ),
        quorum_timeout_s=timeouts.quorum,
        heartbeat_interval_s=timeouts.heartbeat / HEARTBEATS_PER_TIMEOUT,
        watch_rounds=watch_rounds,
        lane_watch=LaneWatcher(client, poll_s=timeouts.quorum),
        probes=ReachProbes(timeouts.probe, timeouts.heartbeat / HEARTBEATS_PER_TIMEOUT) if member.leader else None,
    )


def synchronizer_parts(
    manager: Manager,
    timeouts: TimeoutsConfig,
    *,
    lane_bandwidth_mbps: float,
    commit_log: Path | None,
    faults: FaultHook | None,
) -> dict[str, Any]:
    """What every synchronizer (``OuterSync``, the job's data-parallel ``GradientSync``) is built with."""
    return dict(
        manager=manager,
        collective_timeout_s=timeouts.collective,
        end_wait_s=timeouts.end + timeouts.quorum,
        commit_log=commit_log,
        faults=faults,
        bucket=bucket_for(lane_bandwidth_mbps),
    )


def build_outer_sync(
    settings: OuterSettings,
    member: Membership,
    *,
    model: nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    device: torch.device,
    commit_log: Path | None = None,
    faults: FaultHook | None = None,
) -> OuterSync:
    """DiLoCo or Streaming DiLoCo over ``model``'s parameters (this worker's shard of them).

    Not started: ``start()`` it before the first round and ``close()`` it at the end.
    """
    algo, outer_opt = cut_warmups(settings.algo, settings.outer_opt, settings.max_steps, settings.warmup_share)
    fragments = build_fragments(algo, outer_opt, model, device, settings.n_blocks)
    plan = FixedPlan(algo, device)
    extra = {}
    if algo.auto:
        plan = AutoOverlap(algo, max(sum(g.numel() for g in f.global_) for f in fragments), device)
        extra = {"auto.plan": plan.plan}
    heal_state = HealState(
        global_params=[f.global_ for f in fragments],
        outer_optimizers=[f.optimizer for f in fragments],
        inner_optimizer=inner_optimizer,
        extra=extra,
    )
    manager = build_manager(member, settings.timeouts, watch_rounds=algo.window == "time")
    parts = synchronizer_parts(
        manager,
        settings.timeouts,
        lane_bandwidth_mbps=settings.lane_bandwidth_mbps,
        commit_log=commit_log,
        faults=faults,
    )
    return OuterSync(
        algo=algo, fragments=fragments, plan=plan, max_steps=settings.max_steps, heal_state=heal_state, **parts
    )


def build_fragments(
    algo: AlgoConfig, outer_opt: OuterOptConfig, model: nn.Module, device: torch.device, n_blocks: int | None = None
) -> list[Fragment]:
    """Split this worker's shard of θ_l into P fragments, each with an fp32 CPU θ_g and an outer optimizer.

    A pipeline stage may hold no block of a fragment: it still takes part in that fragment's
    rounds (every stage of a group commits a round or none does) with an empty tensor in its place.
    """
    params = dict(model.named_parameters())
    blocks = count_blocks(list(params)) if n_blocks is None else n_blocks
    names = fragment_parameter_names(list(params), blocks, algo.fragments, algo.pattern)
    fragments = []
    for index, fragment_names in enumerate(names):
        local = [local_tensor(params[n]).detach() for n in fragment_names] or [torch.zeros(0, device=device)]
        owned = [counted_here(params[n]) for n in fragment_names] or [True]
        global_ = global_copy(local, pin_memory=device.type == "cuda")
        optimizer = build_outer_optimizer(global_, outer_opt)
        fragments.append(
            Fragment(
                index=index,
                local=local,
                global_=global_,
                optimizer=optimizer,
                momentum=optimizer.param_groups[0].get("momentum"),
                momentum_warmup_steps=outer_opt.momentum_warmup_steps,
                owned=owned,
            )
        )
    return fragments


def control_group(world_size: int, timeout_s: float) -> dist.ProcessGroup | None:
    """The group's own Gloo group for the manager's small messages (quorum, commit votes).

    Separate from the group's training process group because an outer round runs on a background
    thread while the training thread's FSDP collectives go on: two threads must never share one
    group. Every rank creates it at the same point (here), as ``new_group`` requires.
    """
    if world_size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
