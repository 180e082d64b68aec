"""The builders that wire one worker's parts: data, inner optimizer, replica, trainer, fault hook and
metrics sink, each from the job config and the worker's place in its group; and the launcher's
preflight, which builds what every worker would before any process starts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from diloco.config.base import to_dict
from diloco.config.cluster import group_name
from diloco.config.faults import FaultsConfig
from diloco.config.job import JobConfig
from diloco.config.redaction import redacted
from diloco.ft.fault_requests import FaultHook
from diloco.outer.synchronizer import Synchronizer
from diloco.run_paths import RunPaths
from diloco.train.block_wrappers import apply_block_wrappers, check_compile, will_run_on_cpu
from diloco.train.checkpoint import check_compatible, check_rank, rank_dir, resolve_resume
from diloco.train.data import ShardedBatches, data_repeats_warning, eval_batches, load_corpus, shard_windows
from diloco.train.device import check_device
from diloco.train.flops import Peak, Utilization, device_peak, flops_per_token
from diloco.train.hf_weights import check_pretrained, load_pretrained
from diloco.train.inner_opt import build_inner_optimizer
from diloco.train.logger import MetricsLogger, rename_wandb_run, start_wandb
from diloco.train.model import Transformer, count_parameters, meta_model, param_signature
from diloco.train.muon import hidden_matrices
from diloco.train.pipeline import PipelineRunner, split_for_worker
from diloco.train.trainer import CheckpointCallback, MetricsCallback, Trainer


def build_data(job: JobConfig, group: int, worker: int, num_workers: int) -> tuple[ShardedBatches, list]:
    """This worker's training batches and evaluation batches; fails fast on bad data."""
    splits = load_corpus(job.data)
    t = job.trainer
    batches = ShardedBatches(
        splits.train,
        seq_len=t.seq_len,
        micro_batch_size=t.batch_size,
        grad_accum=t.grad_accum,
        group=group,
        num_groups=job.cluster.groups,
        worker=worker,
        num_workers=num_workers,
        seed=t.seed,
    )
    evals = eval_batches(
        splits.val,
        seq_len=t.seq_len,
        batch_size=t.batch_size,
        max_batches=t.eval_batches,
        worker=worker,
        num_workers=num_workers,
    )
    return batches, evals


InnerOptimizer = tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]


def build_inner(job: JobConfig, model: torch.nn.Module) -> InnerOptimizer:
    """The inner optimizer and its lr schedule for this worker's part of the model (a pipeline stage: its own
    parameters); built before the outer synchronizer, which heals its state."""
    params = list(model.parameters())
    return build_inner_optimizer(params, job.inner_opt, job.trainer.max_steps, hidden_matrices(model))


def build_trainer(
    job: JobConfig,
    model: torch.nn.Module,
    *,
    group: int,
    worker: int,
    num_workers: int,
    device: torch.device,
    inner: InnerOptimizer | None = None,
    sharded: bool = False,
    outer: Synchronizer | None = None,
    on_metrics: MetricsCallback | None = None,
    on_checkpoint: CheckpointCallback | None = None,
    stop_requested: Callable[[], bool] | None = None,
    pipeline: PipelineRunner | None = None,
    handed_peak: Peak | None = None,
) -> Trainer:
    """The inner loop of one worker, complete: optimizer, schedule and data for its place in the job.

    ``worker`` and ``num_workers`` are its data-parallel index and the group's dp degree (the tp
    workers and pipeline stages of one dp index read the same batches). ``inner`` is the optimizer
    ``outer`` was built with (``build_inner``); a new one otherwise. ``handed_peak``: the
    device's peak the local launcher measured (``WorkerEnv.peak``), for MFU.
    ``outer`` is not started here: its owner starts and closes it around ``fit``.
    """
    optimizer, scheduler = inner if inner is not None else build_inner(job, model)
    batches, evals = build_data(job, group, worker, num_workers)
    return Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        batches=batches,
        eval_set=evals,
        cfg=job.trainer,
        grad_clip=job.inner_opt.grad_clip,
        device=device,
        sharded=sharded,
        on_metrics=on_metrics,
        outer=outer,
        on_checkpoint=on_checkpoint,
        stop_requested=stop_requested,
        pace=straggler_pace(job.faults, group),
        utilization=Utilization(
            flops_per_token(job.model, job.trainer.seq_len),
            device_peak(job.cluster.peak_tflops, device, handed_peak).tflops
            * num_workers
            * job.parallel.tp
            * job.parallel.pp,  # devices
        ),
        pipeline=pipeline,
    )


def preflight(job: JobConfig, paths: RunPaths, warn: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Check, in the launching process, what would otherwise fail inside every worker.

    Loads the data for every group (a missing or corrupt path, or a shard too small, is
    reported before any process starts), checks the device exists and that every group has
    a checkpoint of this job's shape to resume from; returns the model's parameter count and
    signature. ``warn`` gets what is allowed but likely unmeant (steps that read the data more
    than once), once, for the launcher to say with its start lines.
    """
    check_device(job.cluster.device)
    check_compile(job.trainer, on_cpu=will_run_on_cpu(job.cluster.device))
    for group in range(job.cluster.groups):
        build_data(job, group, 0, job.parallel.dp(job.cluster.workers_per_group))
    if warn and (repeats := data_repeats_warning(job, load_corpus(job.data).train.numel())):
        warn(repeats)
    model = meta_model(job.model)
    signature = param_signature(job.model, model)
    if job.model.init_from:  # a tensor missing or misshapen, from the headers, before any worker starts
        check_pretrained(model, job.model.init_from)
    if folders := resume_folders(job, paths):
        identity = checkpoint_identity(job, signature, job.cluster.workers_per_group)
        for folder in folders.values():
            check_compatible(folder, identity)
            for rank in range(job.cluster.workers_per_group):
                check_rank(rank_dir(folder, rank))
    return count_parameters(model), signature


@dataclass
class Replica:
    """What every worker builds alike, whichever group it is in: a warm spare builds it before it knows its group."""

    device: torch.device
    model: torch.nn.Module
    sharded: bool
    inner: InnerOptimizer
    n_params: int
    signature: str
    pipeline: PipelineRunner | None = None  # with parallel.pp > 1: the schedule that runs this worker's stages


def build_replica(
    job: JobConfig, mesh: DeviceMesh, device: torch.device, rank: int, handed_peak: Peak | None = None
) -> Replica:
    """Worker ``rank``'s part of the model, sharded, with its inner optimizer (and pipeline
    schedule); its log says the device's peak (``handed_peak`` as ``build_trainer``'s)."""
    from diloco.worker.sharding import shard_model  # lazily: the launcher imports this module for preflight

    torch.manual_seed(job.trainer.seed)  # identical initial weights on every worker and group
    model = Transformer(job.model)  # on the host: with pipeline stages, only the worker's own go to the device
    if job.model.init_from:  # whole, before sharding: θ_l and the θ_g copied from it start pretrained
        load_pretrained(model, job.model)
    n_params, signature = count_parameters(model), param_signature(job.model, model)
    apply_block_wrappers(model.layers.values(), job.trainer, device)  # lazy: traced at the first forward
    # Measured (if it must be) before a spare takes over.
    peak = device_peak(job.cluster.peak_tflops, device, handed_peak)
    if rank == 0:  # a group's devices are alike; under torchrun every rank shares the terminal
        print(f"peak {peak.tflops:.4g} TFLOP/s per device ({peak.source})", flush=True)
    parallel = job.parallel
    position = parallel.pp_index(rank, job.cluster.workers_per_group)
    if parallel.pp > 1:
        model = split_for_worker(model, parallel, position)
    model = model.to(device)
    sharded = shard_model(model, mesh, device, sequence_parallel=parallel.sequence_parallel)
    pipeline = None
    if parallel.pp > 1:
        microbatches = parallel.microbatches(job.trainer.microbatches)
        pipeline = PipelineRunner(model, parallel, position, mesh["pp"].get_group(), device, microbatches)
    return Replica(device, model, sharded, build_inner(job, model), n_params, signature, pipeline)


def resume_folders(job: JobConfig, paths: RunPaths) -> dict[int, Path] | None:
    """Each group's checkpoint folder for ``trainer.resume`` (see ``checkpoint.resolve_resume``);
    None: the job starts fresh."""
    if not job.trainer.resume:
        return None
    search_dir = Path(job.trainer.checkpoint.search_dir)
    return resolve_resume(job.trainer.resume, paths.root, search_dir, job.cluster.groups)


def checkpoint_identity(job: JobConfig, signature: str, workers: int) -> dict[str, object]:
    """What a checkpoint must share with the job resuming from it: each worker restores its own
    shard, and each group reads on in the same stream of windows (other data would make the
    saved read position mean other windows: the worker would refuse it, after the launcher started it)."""
    train_tokens = load_corpus(job.data).train.numel()
    return {
        "model": dataclasses.asdict(job.model),  # before the signature: a refusal names the keys that differ
        "signature": signature,
        "groups": job.cluster.groups,
        "workers": workers,
        "tp": job.parallel.tp,  # each rank's shards are cut by the mesh
        "pp": job.parallel.pp,
        "pp_blocks": job.parallel.blocks_per_stage(job.model.n_layers),  # and which blocks each stage holds
        "algo": job.algo.name,
        "inner_opt": job.inner_opt.name,  # each optimizer keeps other state tensors
        "outer_opt": job.outer_opt.name,
        "fragments": job.algo.fragments,
        "windows_per_group": shard_windows(train_tokens, job.cluster.groups, job.trainer.seq_len),
        "data_seed": job.trainer.seed,
    }


def fault_hook(job: JobConfig, paths: RunPaths, started_at: float) -> FaultHook | None:
    """Only a job that injects faults into workers has them read fault requests (none otherwise)."""
    if not job.faults.in_workers:
        return None
    group = job.group.id
    return FaultHook(paths.fault_requests(group), since=started_at, group=group_name(group))


def metrics_logger(job: JobConfig, paths: RunPaths, started: Any | None = None) -> MetricsLogger:
    """The leader's metrics sink: the group's metrics file, and wandb when the logger config asks
    for it (``started``: the run a warm spare started before it knew its group)."""
    group = job.group.id
    names = dict(member=group_name(group), job_name=job.name, config=redacted(to_dict(job)))
    if started is not None:
        rename_wandb_run(started, job.logger, **names)
        return MetricsLogger(paths.metrics(group), started)
    return MetricsLogger(paths.metrics(group), start_wandb(job.logger, run_dir=paths.root, **names))


def straggler_pace(cfg: FaultsConfig, group: int) -> Callable[[float], None] | None:
    """What the slow group does after each inner step of ``seconds``: sleep (slowdown − 1) times
    as long, so it computes at its own pace and lends the machine to nobody (None elsewhere)."""
    if group != cfg.slow_group or cfg.slowdown == 1:
        return None
    extra = cfg.slowdown - 1
    return lambda seconds: time.sleep(extra * seconds)
