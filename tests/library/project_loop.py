"""This project's model and data trained in a plain loop of one's own through ``DiLoCo``: one
replica group of one worker, doing per step what the job's ``Trainer.train_step`` does.

    python tests/library/project_loop.py JOB_JSON OUT [--raise-at N]

``JOB_JSON``: a job's config (a run directory's job.json, or one a test wrote), read for its model,
data, inner optimizer, trainer and outer settings, so the loop trains what ``python run.py`` with
those settings trains. The group, lighthouse and job come from ``DILOCO_GROUP`` and
``DILOCO_LIGHTHOUSE``. ``OUT``: where the final model's state dict goes (torch.save). Lines on
stdout say how far it got (``entered STEP``, ``step STEP``, ``result DIGEST ROUNDS HOLDS``), for a
test to follow; ``--raise-at`` raises from inside the block after that inner step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from diloco import DiLoCo
from diloco.config.job import JobConfig, job_config_from_dict
from diloco.train.block_wrappers import apply_block_wrappers
from diloco.train.data import ShardedBatches
from diloco.train.model import Transformer
from diloco.train.trainer import next_token_loss
from diloco.worker.builders import build_data, build_inner


class UserStop(RuntimeError):
    """What ``--raise-at`` raises: a user's loop failing mid-job."""


def load_job(path: Path, group: int) -> JobConfig:
    raw = json.loads(path.read_text())
    raw["group"] = {"id": group}
    return job_config_from_dict(raw)


def build_model(job: JobConfig, device: torch.device) -> nn.Module:
    """As ``build_replica`` builds a group of one worker's model (no sharding)."""
    torch.manual_seed(job.trainer.seed)  # the same initial weights in every group
    model = Transformer(job.model)
    apply_block_wrappers(model.layers.values(), job.trainer, device)
    return model.to(device)


def move_to(step: int, batches: ShardedBatches, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """After a heal: the data position and lr schedule of ``step``, as ``Trainer.set_step`` sets them."""
    batches.consumed = step * batches.tokens_per_step // batches.seq_len
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("job_json", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--raise-at", type=int, default=0)
    args = parser.parse_args()
    group = int(os.environ["DILOCO_GROUP"])
    job = load_job(args.job_json, group)
    device = torch.device("cpu")
    model = build_model(job, device)
    optimizer, scheduler = build_inner(job, model)
    batches, _ = build_data(job, group, 0, 1)
    max_norm = job.inner_opt.grad_clip if job.inner_opt.grad_clip > 0 else math.inf
    with DiLoCo(
        model,
        optimizer,
        max_steps=job.trainer.max_steps,
        algo=job.algo,
        outer_opt=job.outer_opt,
        warmup_share=job.trainer.warmup_share,
        timeouts=job.cluster.timeouts,
    ) as outer:
        print(f"entered {outer.step}", flush=True)
        expected = 0
        while not outer.done:
            if outer.step != expected:  # healed from a peer: the job's clock jumped
                move_to(outer.step, batches, scheduler)
            expected = outer.step + 1
            micro_batches = batches.next_step()
            for batch in micro_batches:
                loss = next_token_loss(model, batch, device)
                (loss / len(micro_batches)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            outer.after_inner_step(tokens=batches.tokens_per_step)
            print(f"step {outer.step}", flush=True)
            if args.raise_at and outer.step >= args.raise_at:
                raise UserStop(f"the user's loop failed at inner step {outer.step}")
    result = outer.result
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.out)
    print(f"result {result.digest} {result.rounds} {result.holds_final_model}", flush=True)


if __name__ == "__main__":
    main()
