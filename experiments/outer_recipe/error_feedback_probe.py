"""What a topk job's error-feedback buffers hold when it ends, applied to its global model.

SparseLoCo (``algo.compress=topk``) keeps what each group did not send of β·e + Δ in its buffer
e, and the job's last round leaves it there. Is that progress θ_g never got (the
measured sparse rows lose ground to DiLoCo in the last rounds)? This reads the job's last checkpoint (run
the job with ``trainer.checkpoint.every`` a divisor of ``trainer.max_steps``), forms

    θ' = θ_g − c · lr · β · ē        (ē: the groups' mean e)

which at c = 1 is what one more round with Δ = 0, sent whole, would apply, and evaluates θ' on
the job's held-out windows as ``role=eval`` does (c = 0 is the job's own final eval loss). It
also prints ‖ē‖ against the groups' ‖e‖: for M buffers that share nothing ‖ē‖ is about
‖e‖/√M, for M equal ones ‖e‖.

    python -m experiments.outer_recipe.error_feedback_probe RUN_DIR --scales 0 0.25 0.5 1
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from diloco.config.job import JobConfig, job_config_from_dict
from diloco.launch.inference import checkpoint_global_weights, evaluate_checkpoint
from diloco.outer.fragments import fragment_parameter_names
from diloco.train.checkpoint import complete_info, rank_dir, read_rank
from diloco.train.model import meta_model


def last_checkpoint(run_dir: Path) -> list[Path]:
    """The group folders of the run's newest checkpoint that every group completed."""
    for step in sorted((run_dir / "checkpoints").glob("step-*"), reverse=True):
        groups = sorted(step.glob("group-*"))
        if groups and all(complete_info(g) is not None for g in groups):
            return groups
    raise SystemExit(f"{run_dir}: no complete checkpoint; run the job with trainer.checkpoint.every set")


def fragments(job: JobConfig) -> list[list[str]]:
    """Each fragment's parameter names, in the order its flat e holds them."""
    names = [name for name, _ in meta_model(job.model).named_parameters()]
    return fragment_parameter_names(names, job.model.n_layers, job.algo.fragments, job.algo.pattern)


def flushed(
    theta: dict[str, torch.Tensor], mean_errors: list[torch.Tensor], parts: list[list[str]], scale: float
) -> dict[str, torch.Tensor]:
    """θ_g − scale · ē by parameter name (``scale`` = c · lr · β; ē per fragment, flat)."""
    state = {}
    for part, mean_e in zip(parts, mean_errors, strict=True):
        offset = 0
        for name in part:
            state[name] = theta[name] - scale * mean_e[offset : offset + theta[name].numel()].view_as(theta[name])
            offset += theta[name].numel()
        assert offset == mean_e.numel(), f"e holds {mean_e.numel()} values, θ_g {offset}"
    return state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished topk job's run directory with a checkpoint")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0], help="values of c")
    args = parser.parse_args(argv)
    job = job_config_from_dict(json.loads((args.run_dir / "job.json").read_text()))
    if job.algo.compress != "topk" or job.cluster.workers_per_group != 1:
        raise SystemExit(f"{args.run_dir}: needs a job with algo.compress=topk and one worker per group")
    groups = last_checkpoint(args.run_dir)
    shards = [read_rank(rank_dir(g, 0)) for g in groups]
    theta = checkpoint_global_weights(groups[0], job)
    parts = fragments(job)
    lr, beta = job.outer_opt.lr, job.algo.error_decay
    mean_errors = [torch.stack([s[f"error.{p}"] for s in shards]).mean(0) for p in range(len(parts))]
    each = [torch.cat([s[f"error.{p}"] for p in range(len(parts))]).norm().item() for s in shards]
    mean = torch.cat(mean_errors).norm().item()
    print(f"{groups[0].parent}: {len(groups)} groups, outer lr {lr}, β {beta}")
    print(f"‖e‖ of each group: {', '.join(f'{n:.3f}' for n in each)}; ‖ē‖ {mean:.3f}")
    print(f"(sharing nothing: about {sum(each) / len(each) / math.sqrt(len(each)):.3f}; equal: {max(each):.3f})\n")
    print(f"| c | eval loss | vs c = {args.scales[0]:g} |\n| ---: | ---: | ---: |")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for c in args.scales:
            weights = Path(tmp) / "flushed.pt"
            torch.save(flushed(theta, mean_errors, parts, c * lr * beta), weights)
            loss = evaluate_checkpoint(job, weights, job)["eval_loss"]
            base = loss if base is None else base
            print(f"| {c:g} | {loss:.4f} | {100 * (loss / base - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
