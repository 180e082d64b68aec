"""Multi-process training of one replica group: real worker processes, real Gloo, real FSDP2."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from diloco.launcher import launch
from diloco.logger import read_jsonl
from diloco.model import Transformer
from diloco.run_paths import RunPaths
from tests.conftest import REPO

pytestmark = pytest.mark.slow
UNTRAINED_LOSS = math.log(256)


def test_two_worker_fsdp_group_trains_and_its_loss_falls(fast_job, tmp_path):
    job = fast_job("trainer.max_steps=40", "trainer.eval_every=20")
    summary = launch(job, tmp_path)
    records = read_jsonl(RunPaths(tmp_path).metrics(0))
    losses = [r["train/loss"] for r in records if r.get("train/loss") is not None]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 1.0, losses
    assert [r["step"] for r in records if "eval/loss" in r] == [20, 40]
    assert summary["final_eval_loss"] < UNTRAINED_LOSS - 1.0
    assert summary["tokens_seen"] == 40 * job.trainer.batch_size * 2 * job.trainer.seq_len
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(weights) == set(Transformer(job.model).state_dict())


def _one_step_weights(fast_job, path, *overrides):
    launch(
        fast_job(
            "trainer.max_steps=1",
            "algo.sync_every=1",
            "outer_opt=avg",
            "trainer.eval_batches=1",
            "cluster.device=cpu",
            *overrides,
        ),
        path,
    )
    return torch.load(path / "model.pt", weights_only=True)


def test_one_fsdp_step_equals_single_process_step_on_the_same_global_batch(fast_job, tmp_path):
    sharded = _one_step_weights(fast_job, tmp_path / "fsdp", "cluster.workers_per_group=2", "trainer.batch_size=4")
    single = _one_step_weights(fast_job, tmp_path / "single", "cluster.workers_per_group=1", "trainer.batch_size=8")
    accum = _one_step_weights(
        fast_job, tmp_path / "accum", "cluster.workers_per_group=1", "trainer.batch_size=4", "trainer.grad_accum=2"
    )
    initial = Transformer(fast_job().model).state_dict()
    for name, tensor in single.items():
        assert not torch.equal(tensor, initial[name]) or tensor.ndim == 1, f"{name} did not move"
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=2e-6, msg=f"FSDP vs single: {name}")
        torch.testing.assert_close(accum[name], tensor, rtol=0, atol=2e-6, msg=f"grad accum vs single: {name}")


def test_python_run_py_end_to_end_with_offline_wandb(tmp_path):
    """What a new user runs, shortened: the run directory holds everything the README promises."""
    result = subprocess.run(
        [
            sys.executable,
            "run.py",
            "trainer.max_steps=40",
            "algo.sync_every=20",
            "trainer.eval_every=20",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parameters" in result.stdout and "done: eval loss" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("final_train_loss", "final_eval_loss", "tokens_seen", "wall_seconds", "tokens_per_s", "parameters"):
        assert key in summary, key
    assert summary["final_eval_loss"] < UNTRAINED_LOSS - 1.0
    assert summary["groups"] == 2 and summary["rounds"] >= 2 and summary["bytes_sent"] > 0
    assert len({g["digest"] for g in summary["per_group"]}) == 1
    assert (tmp_path / "config.yaml").read_text().startswith("model:")
    assert (tmp_path / "model.pt").exists()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2, list(tmp_path.rglob("*"))  # one wandb run per group, grouped by job
