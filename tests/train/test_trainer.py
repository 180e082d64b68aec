"""The inner loop in one process (no process group): loss falls, and its position resumes exactly."""

from __future__ import annotations

import pytest
import torch

from diloco.train.flops import device_peak, flops_per_token
from diloco.train.model import Transformer
from diloco.train.sync_hooks import NoSync
from diloco.train.trainer import Trainer
from diloco.worker.builders import build_trainer
from tests.conftest import compose_job


def _trainer(job, metrics=None) -> Trainer:
    torch.manual_seed(job.trainer.seed)
    on_metrics = None if metrics is None else lambda m, s: metrics.append((s, m))
    model = Transformer(job.model)
    return build_trainer(
        job, model, group=0, worker=0, num_workers=1, device=torch.device("cpu"), on_metrics=on_metrics
    )


@pytest.mark.slow  # trains a model (~3 s)
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
    result = _trainer(job, metrics).fit()
    by_step: dict[int, dict] = {}
    for step, record in metrics:
        by_step.setdefault(step, {}).update(record)
    assert sorted(by_step) == [10, 15, 20, 30]
    first, last = by_step[10], by_step[30]
    for key in ("train/loss", "train/lr", "train/tokens_per_s", "train/tflops", "train/mfu", "eval/loss", "eval/ppl"):
        assert key in last, key
    assert last["train/loss"] < first["train/loss"]
    assert last["train/tflops"] == pytest.approx(last["train/tokens_per_s"] * flops_per_token(job.model, 64) / 1e12)
    peak = device_peak(job.cluster.peak_tflops, torch.device("cpu"))  # measured: this one process's
    assert last["train/mfu"] == pytest.approx(last["train/tflops"] / peak.tflops)
    assert result.tokens_seen == 30 * job.trainer.batch_size * job.trainer.seq_len
    assert result.final_eval_loss == last["eval/loss"]


def test_without_a_synchronizer_a_planned_stop_is_agreed_at_a_log_line():
    """``NoSync`` never holds a round in flight: the stop waits for the next log line only."""
    job = compose_job(
        ["algo=local", "trainer.max_steps=20", "trainer.log_every=5", "trainer.seq_len=32", "trainer.batch_size=2"]
    )
    trainer = _trainer(job)
    trainer.stop_requested = lambda: True
    result = trainer.fit()
    assert isinstance(trainer.outer, NoSync)
    assert result.interrupted and result.steps == 5


def test_progress_state_resumes_data_and_lr_without_replay():
    job = compose_job(["algo.sync_every=10", "trainer.max_steps=10", "trainer.seq_len=32", "trainer.batch_size=2"])
    original = _trainer(job)
    for _ in range(4):
        original.train_step()
    state = original.progress_state()
    restarted = _trainer(job)
    restarted.load_progress_state(state)
    assert restarted.step == 4
    assert restarted.optimizer.param_groups[0]["lr"] == original.optimizer.param_groups[0]["lr"]
    expected = original.batches.next_step()
    resumed = restarted.batches.next_step()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, resumed))
