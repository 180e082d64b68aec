"""One worker process of a replica group: wires model, data, optimizer and trainer, then trains.

Run by the embedded launcher as ``python -m diloco.worker --run-dir DIR --group G`` with
torchrun's variables in the environment (``cluster.spawn=exec``), forked from a warm
``diloco.launch.forkserver`` (``cluster.spawn=fork``), or through ``run.py role=group`` under torchrun;
as part of a warm spare (``--spare K``), it builds first and learns its group later.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import signal
import threading
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from diloco import lifeline
from diloco.config.base import ConfigError, to_dict
from diloco.config.cluster import group_name
from diloco.config.job import GroupConfig, JobConfig, job_config_from_dict
from diloco.config.redaction import redacted
from diloco.exits import (
    INTERRUPTED_EXIT_CODE,
    JOB_ENDED_EXIT_CODE,
    REFUSED_EXIT_CODE,
    REFUSED_PREFIX,
    exit_without_teardown,
)
from diloco.files import write_atomically, write_json_atomically
from diloco.ft.manager import JobEndedError
from diloco.ft.state import is_dtensor
from diloco.process_logging import output_to, setup_process_logging
from diloco.run_paths import RunPaths
from diloco.train.checkpoint import check_compatible, describe_resume
from diloco.train.device import select_device
from diloco.train.logger import start_wandb
from diloco.train.pipeline import StageChunks, gather_stages
from diloco.train.trainer import TrainResult
from diloco.worker.builders import (
    Replica,
    build_replica,
    build_trainer,
    checkpoint_identity,
    fault_hook,
    metrics_logger,
    resume_folders,
)
from diloco.worker.env import WorkerEnv
from diloco.worker.outer_builder import build_outer_sync
from diloco.worker.spares import SpareAssignmentError, wait_for_assignment
from diloco.worker.state import WorkerState


def refuse_finished_group(paths: RunPaths, group: int) -> None:
    """A group that already finished in this run directory must not run again on top of its result.

    (A group restarted mid-job by its orchestrator has no result yet, and goes on.)
    """
    if paths.result(group).exists():
        raise ConfigError(
            f"hydra.run.dir={paths.root}: group {group} already finished a run here ({paths.result(group)}); "
            "pick a new hydra.run.dir for a new job"
        )


def run_worker(
    job: JobConfig, env: WorkerEnv, paths: RunPaths, started_at: float = 0.0, spare: int | None = None
) -> dict[str, Any]:
    """Train this worker's part of replica group ``job.group.id``; returns the group's result record.

    The leader logs, writes the result and, if the lighthouse named this group at the job's
    end, saves the final model. ``started_at`` is when the launcher started this process
    (fault requests before it were meant for an earlier process of the group). A worker of
    warm spare ``spare`` (diloco.worker.spares) builds its replica (its leader starts its wandb run
    too, the slowest part of a start once torch is imported), then waits for the group it
    replaces, and from then on is that group's worker.
    """
    # Imported here, not above: run.py imports this module for every role and would pay FSDP's
    # imports (1 s) for nothing; a worker forked from the fork server finds them loaded.
    from diloco.worker.sharding import init_group

    setup_process_logging()
    stop = _stop_on_signals() if spare is None else None  # a waiting spare just dies when told to
    device = select_device(job.cluster.device, env.local_rank)
    mesh = init_group(
        env,
        device,
        parallel=job.parallel,
        connect_timeout_s=job.cluster.timeouts.connect,
        collective_timeout_s=job.cluster.timeouts.collective,
    )
    try:
        replica = build_replica(job, mesh, device, env.rank, env.peak)
        wandb_run = None
        if spare is not None:
            if env.rank == 0:
                wandb_run = start_wandb(
                    job.logger,
                    run_dir=paths.root,
                    member=f"spare{spare}",
                    job_name=job.name,
                    config=redacted(to_dict(job)),
                )
            job, started_at = _take_assignment(job, env, paths, paths.spare_pipe(spare, env.rank))
            stop = _stop_on_signals()
        return _train_group(job, env, paths, replica, stop, started_at, wandb_run)
    finally:
        dist.destroy_process_group()


def _take_assignment(job: JobConfig, env: WorkerEnv, paths: RunPaths, pipe: Path) -> tuple[JobConfig, float]:
    """Wait for the group this spare replaces; from then on log where that group's worker logs."""
    assignment = wait_for_assignment(pipe)
    if assignment.group >= job.cluster.groups:
        raise SpareAssignmentError(f"{pipe}: group {assignment.group} is not in this job of {job.cluster.groups}")
    output_to(paths.worker_log(assignment.group, env.rank))
    print(f"warm spare {pipe.name} takes over group {assignment.group}", flush=True)
    return dataclasses.replace(job, group=GroupConfig(id=assignment.group)), assignment.started_at


def _train_group(
    job: JobConfig,
    env: WorkerEnv,
    paths: RunPaths,
    replica: Replica,
    stop: threading.Event,
    started_at: float,
    wandb_run: Any | None,
) -> dict[str, Any]:
    """Join the job as a worker of ``job.group.id`` with a built replica (and the leader's wandb
    run, if a spare started it), train, report."""
    group = job.group.id
    leader = env.rank == 0
    model, sharded, inner, signature = replica.model, replica.sharded, replica.inner, replica.signature
    outer = None
    if job.algo.name != "local":
        outer = build_outer_sync(
            job,
            env,
            model=model,
            inner_optimizer=inner[0],
            signature=signature,
            device=replica.device,
            commits_path=paths.commits(group),
            faults=fault_hook(job, paths, started_at),
        )
    logger = None
    if leader:
        print(f"group {group}: model has {replica.n_params:,} parameters", flush=True)
        logger = metrics_logger(job, paths, wandb_run)
    state = WorkerState(
        model=model,
        inner_optimizer=inner[0],
        outer=outer,
        rank=env.rank,
        identity=checkpoint_identity(job, signature, env.world_size),
    )
    trainer = build_trainer(
        job,
        model,
        group=group,
        worker=job.parallel.dp_index(env.rank, env.world_size),  # data splits over dp only
        num_workers=job.parallel.dp(env.world_size),
        device=replica.device,
        inner=inner,
        sharded=sharded,
        outer=outer,
        on_metrics=None if logger is None else logger.log,
        on_checkpoint=(lambda t: state.save(t, paths.root, group)) if job.trainer.checkpoint.enabled else None,
        stop_requested=stop.is_set,
        pipeline=replica.pipeline,
        handed_peak=env.peak,
    )
    folders = resume_folders(job, paths)
    if leader and job.trainer.resume:  # under role=group no launcher says it
        print(describe_resume(job.trainer.resume, folders, Path(job.trainer.checkpoint.search_dir)), flush=True)
    if folders:
        folder = folders[group]
        check_compatible(folder, state.identity)
        state.restore(trainer, folder)
    try:
        if outer is not None:
            outer.start()
        result = trainer.fit()
    finally:
        if outer is not None:
            outer.close()
    if result.interrupted and outer is not None:
        outer.load_global_into_local()  # what a planned stop keeps is the last committed global model
    weights = _full_state_dict(model, job, env.rank)
    report = _result_record(group, result, replica.n_params, job.model.vocab_size)
    if outer is not None:
        report |= outer.report()
    if leader:
        report["saved_model"] = not result.interrupted and saves_final_model(job, report)
        if report["saved_model"] or result.interrupted:
            target = paths.interrupted_weights(group) if result.interrupted else paths.weights
            write_atomically(target, lambda fh: torch.save(weights, fh))
        write_json_atomically(paths.result(group), report)
        logger.close(report)
    return report


def _stop_on_signals() -> threading.Event:
    """SIGTERM or SIGINT asks for a planned stop (after the current round, state saved); a second one stops at once."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop  # signal handlers belong to the main thread (a test driving a worker from a thread)

    def ask(signum: int, frame: object) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, ask)
    return stop


def saves_final_model(job: JobConfig, report: dict[str, Any]) -> bool:
    """Every group the lighthouse named a holder of the final state at the job's end saves model.pt
    (the same weights, each file renamed into place whole); group 0 when groups never sync."""
    if job.algo.name == "local":
        return job.group.id == 0
    end = report.get("end")
    return end is not None and group_name(job.group.id) in end["holders"]


def _full_state_dict(model: torch.nn.Module, job: JobConfig, rank: int) -> dict[str, torch.Tensor]:
    """Whole CPU weights on rank 0 (a collective where FSDP2, tensor or pipeline parallelism split
    them: every worker must call it)."""
    roots = list(model.chunks) if isinstance(model, StageChunks) else [model]
    weights: dict[str, torch.Tensor] = {}
    for root in roots:
        if not any(is_dtensor(p) for p in root.parameters()):
            weights |= {k: v.detach().cpu() for k, v in root.state_dict().items()}
            continue
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # With stages, each position's first worker sends its part to rank 0, so it needs it whole
        # too (offloaded, only rank 0 would get it).
        offload = job.parallel.pp == 1
        whole = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
        weights |= {k: v.detach().cpu() for k, v in whole.items()}
    if job.parallel.pp == 1:
        return weights
    return gather_stages(weights, job.model, job.parallel, rank, job.cluster.workers_per_group)


def _result_record(group: int, result: TrainResult, n_params: int, vocab_size: int) -> dict[str, Any]:
    return {
        "group": group,
        "pid": os.getpid(),  # the process its commit records name: the group's earlier ones are the others
        "steps": result.steps,
        "final_train_loss": result.final_train_loss,
        "final_eval_loss": result.final_eval_loss,
        "tokens_seen": result.tokens_seen,
        "resumed_tokens": result.resumed_tokens,
        "train_seconds": result.train_seconds,
        "tokens_per_s": result.tokens_per_s,
        "parameters": n_params,
        "interrupted": result.interrupted,
        "uniform_loss": math.log(vocab_size),  # guessing every token equally likely: what learning must beat
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux counts it in KiB
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path, required=True)
    place = parser.add_mutually_exclusive_group(required=True)
    place.add_argument("--group", type=int, help="the replica group this worker belongs to")
    place.add_argument("--spare", type=int, help="the warm spare this worker belongs to (diloco.worker.spares)")
    parser.add_argument("--started-at", type=float, default=0.0, help="when the launcher spawned this process")
    lifeline.add_argument(parser)
    args = parser.parse_args(argv)
    if args.lifeline_fd is not None:
        lifeline.watch(args.lifeline_fd)
    env = WorkerEnv.from_environ(os.environ)
    run_launched_worker(RunPaths(args.run_dir), args.group, env, args.started_at, spare=args.spare)


def run_launched_worker(
    paths: RunPaths, group: int | None, env: WorkerEnv, started_at: float, spare: int | None = None
) -> NoReturn:
    """What a worker the local launcher started does, exec'd or forked: train ``group``'s part, then
    leave; a worker of warm spare ``spare`` (``group`` None) first waits for the group it replaces."""
    try:
        report = run_worker(load_job(paths, 0 if group is None else group), env, paths, started_at, spare)
    except JobEndedError as error:
        exit_without_teardown(JOB_ENDED_EXIT_CODE, f"error: {error}")
    except ConfigError as error:
        exit_without_teardown(REFUSED_EXIT_CODE, f"{REFUSED_PREFIX}{error}")
    exit_without_teardown(INTERRUPTED_EXIT_CODE if report.get("interrupted") else 0)


def load_job(paths: RunPaths, group: int) -> JobConfig:
    """The job the launcher wrote to the run directory, as seen by a worker of ``group``."""
    raw = json.loads(paths.job.read_text())
    raw["group"] = {"id": group}
    return job_config_from_dict(raw)
