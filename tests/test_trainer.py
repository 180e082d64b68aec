"""The inner loop in one process (no process group): loss falls, and its position resumes exactly."""

from __future__ import annotations

import torch

from diloco.data import ShardedBatches, eval_batches, load_corpus
from diloco.model import Transformer
from diloco.optim import build_inner_optimizer
from diloco.trainer import Trainer
from tests.conftest import compose_job


def _trainer(job, splits, metrics=None) -> Trainer:
    torch.manual_seed(job.trainer.seed)
    model = Transformer(job.model)
    optimizer, scheduler = build_inner_optimizer(list(model.parameters()), job.inner_opt, job.trainer.max_steps)
    t = job.trainer
    batches = ShardedBatches(
        splits.train,
        seq_len=t.seq_len,
        micro_batch_size=t.batch_size,
        grad_accum=t.grad_accum,
        group=0,
        num_groups=1,
        worker=0,
        num_workers=1,
        seed=t.seed,
    )
    evals = eval_batches(splits.val, seq_len=t.seq_len, batch_size=t.batch_size, max_batches=2, worker=0, num_workers=1)
    return Trainer(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        batches=batches,
        eval_set=evals,
        cfg=job.trainer,
        grad_clip=job.inner_opt.grad_clip,
        device=torch.device("cpu"),
        sharded=False,
        on_metrics=(lambda m, s: metrics.append((s, m))) if metrics is not None else None,
    )


def test_fit_logs_the_named_metrics_and_the_loss_falls():
    job = compose_job(
        [
            "algo.sync_every=10",
            "trainer.max_steps=30",
            "trainer.log_every=10",
            "trainer.eval_every=15",
            "trainer.seq_len=64",
        ]
    )
    metrics: list = []
    result = _trainer(job, load_corpus(job.data), metrics).fit()
    steps = [s for s, _ in metrics]
    assert steps == [10, 15, 20, 30]
    first, last = metrics[0][1], metrics[-1][1]
    for key in ("train/loss", "train/lr", "train/tokens_per_s", "eval/loss", "eval/ppl"):
        assert key in last, key
    assert last["train/loss"] < first["train/loss"]
    assert result.tokens_seen == 30 * job.trainer.batch_size * job.trainer.seq_len
    assert result.final_eval_loss == last["eval/loss"]


def test_progress_state_resumes_data_and_lr_without_replay():
    job = compose_job(["algo.sync_every=10", "trainer.max_steps=10", "trainer.seq_len=32", "trainer.batch_size=2"])
    splits = load_corpus(job.data)
    original = _trainer(job, splits)
    for _ in range(4):
        original.train_step()
    state = original.progress_state()
    restarted = _trainer(job, splits)
    restarted.load_progress_state(state)
    assert restarted.step == 4
    assert restarted.optimizer.param_groups[0]["lr"] == original.optimizer.param_groups[0]["lr"]
    expected = original.batches.next_step()
    resumed = restarted.batches.next_step()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, resumed))
