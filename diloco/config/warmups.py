"""The job's outer warm-ups as they run: each cut to ``trainer.warmup_share`` of ``trainer.max_steps``.

Three schedules ramp in over a job's first inner steps: the sync warm-up (windows of H₀ < H
steps up to step W), the mixing α's ramp and the outer momentum μ's ramp. Tuned on 5,000-step
jobs, at their configured lengths they would fill a short job whole, so every value of
``algo.sync_every`` would give the same job. ``scheduled`` cuts each to the share: the sync
warm-up to whole H windows (W stays a multiple of H, so the rounds after it, checkpoints and
the last round fall where they would without it), the ramps to the share in steps.
"""

from __future__ import annotations

from dataclasses import replace

from diloco.config.algo import SYNCING, AlgoConfig
from diloco.config.group_rules import group_alpha
from diloco.config.job import JobConfig
from diloco.schedule import last_window, whole_windows
from outer_opt import OuterOptConfig


def scheduled(job: JobConfig) -> tuple[AlgoConfig, OuterOptConfig]:
    """The job's ``algo`` and ``outer_opt`` with each warm-up as it runs (a cut one shortened)."""
    return cut_warmups(job.algo, job.outer_opt, job.trainer.max_steps, job.trainer.warmup_share)


def cut_warmups(
    algo: AlgoConfig, outer_opt: OuterOptConfig, max_steps: int, share: float
) -> tuple[AlgoConfig, OuterOptConfig]:
    """``algo`` and ``outer_opt`` with each warm-up cut to ``share`` of ``max_steps`` inner steps."""
    if algo.name not in SYNCING or share >= 1:
        return algo, outer_opt
    limit = int(share * max_steps)
    H = algo.sync_every
    sync_steps = min(whole_windows(algo.sync_warmup_steps, H), limit // H * H)
    return (
        replace(algo, sync_warmup_steps=sync_steps, alpha_warmup_steps=min(algo.alpha_warmup_steps, limit)),
        replace(outer_opt, momentum_warmup_steps=min(outer_opt.momentum_warmup_steps, limit)),
    )


def planned_windows(job: JobConfig) -> int:
    """How many sync windows a group runs in ``trainer.max_steps`` (the warm-up's short ones
    included); each window syncs each of the P fragments once. 0 without outer rounds."""
    if job.algo.name not in SYNCING:
        return 0
    max_steps, H = job.trainer.max_steps, job.algo.sync_every
    warmup = scheduled(job)[0].sync_warmup_window()
    short, warm = warmup or (H, 0)
    warm = min(warm, max_steps)  # trainer.warmup_share=1: a warm-up may outlast the job
    return warm // short + (max_steps - warm) // H + (last_window(max_steps, H, warmup) is not None)


def last_window_line(job: JobConfig) -> str | None:
    """``the last window is 34 steps (from step 1200), ending at trainer.max_steps=1234, ...``, when
    the job's last step ends no window (``diloco.schedule.LastWindow``); None when it does."""
    if job.algo.name not in SYNCING:
        return None
    last = last_window(job.trainer.max_steps, job.algo.sync_every, scheduled(job)[0].sync_warmup_window())
    if last is None:
        return None
    synced = "every fragment" if job.algo.fragments > 1 else "the model"
    return (
        f"the last window is {last.end - last.start} steps (from step {last.start}), ending at "
        f"trainer.max_steps={last.end}, where one round syncs {synced}"
    )


def warmup_line(job: JobConfig) -> str | None:
    """One line for the job's start: each warm-up as it will run, what was cut, and the key that
    turns it off; None when the job has none."""
    algo, outer_opt, max_steps = job.algo, job.outer_opt, job.trainer.max_steps
    if algo.name not in SYNCING:
        return None
    run_algo, run_opt = scheduled(job)
    said, keys = [], []
    if window := run_algo.sync_warmup_window():
        short, warm = window
        said.append(f"outer rounds every {short} steps until step {warm}, then every {algo.sync_every}")
        keys.append(_key("algo.sync_warmup_steps", warm, algo.sync_warmup_steps))
    elif algo.sync_warmup_window():
        said.append("no short windows at the start (too few steps for one)")
        keys.append(f"algo.sync_warmup_steps={algo.sync_warmup_steps} cut to 0")
    if run_algo.alpha_warmup_steps and algo.alpha:
        alpha = group_alpha(job)  # at the job's M (its rule in the line after)
        said.append(f"the mixing weight α rising from 0 to {alpha:.3g} over {run_algo.alpha_warmup_steps} steps")
        keys.append(_key("algo.alpha_warmup_steps", run_algo.alpha_warmup_steps, algo.alpha_warmup_steps))
    momentum = outer_opt.momentum if outer_opt.name in ("nesterov", "sgd") else 0.0
    if run_opt.momentum_warmup_steps and momentum:
        said.append(f"the outer momentum rising from 0 to {momentum:g} over {run_opt.momentum_warmup_steps} steps")
        keys.append(
            _key("outer_opt.momentum_warmup_steps", run_opt.momentum_warmup_steps, outer_opt.momentum_warmup_steps)
        )
    if not said:
        return None
    return (
        f"warm-up: {'; '.join(said)} ({', '.join(keys)}; each at most trainer.warmup_share="
        f"{job.trainer.warmup_share:.0%} of the {max_steps} steps; a key =0 turns its warm-up off)"
    )


def _key(name: str, run: int, configured: int) -> str:
    """``algo.alpha_warmup_steps=1000 cut to 100``: the key, and what the share shortened it to."""
    return f"{name}={configured}" + (f" cut to {run}" if run < configured else "")
