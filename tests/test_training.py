"""Multi-process training of one replica group: real worker processes, real Gloo, real FSDP2."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys

import pytest
import torch

from diloco.launch.launcher import launch
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from diloco.train.model import Transformer
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
    assert json.loads(RunPaths(tmp_path).result(0).read_text())["uniform_loss"] == UNTRAINED_LOSS  # the bar to beat
    assert summary["tokens_seen"] == 40 * job.trainer.batch_size * 2 * job.trainer.seq_len
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(weights) == set(Transformer(job.model).state_dict())


def test_a_job_whose_training_diverges_after_some_rounds_ends_early_naming_the_last_good_round(fast_job, tmp_path):
    """Every group's updates turn NaN after a few rounds at this inner lr: the rounds after commit
    nothing, and the model saved is an early round's. That is no trained model (it exited 0), and
    after algo.diverged_rounds such rounds the job ends instead of training on to max_steps."""
    job = fast_job(
        "cluster.groups=2",
        "cluster.workers_per_group=1",
        "trainer.max_steps=200",
        "inner_opt.lr=100",
        "algo.diverged_rounds=3",
    )
    summary = launch(job, tmp_path)
    assert not summary["ok"] and 0 < summary["rounds"] < 8, summary
    assert summary["failure"].startswith(
        "training diverged: the last 3 update(s) of every group were "
        f"non-finite (NaN or inf), so nothing was committed after round {summary['rounds']} and model.pt holds"
    ), summary["failure"]
    steps_per_group = 10 * (summary["rounds"] + 3)  # H = 10
    assert summary["tokens_seen"] == 2 * steps_per_group * job.trainer.batch_size * job.trainer.seq_len


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


def test_a_sweeps_jobs_get_their_own_wandb_names_in_one_group_and_a_sweep_table(tmp_path):
    """``python run.py -m``: each job's wandb runs are named by its overrides and grouped by the
    sweep; sweep.md in the sweep directory has one row per job. A failed job (the first: H=0) does not stop the others,
    and the sweep exits 1 with its reason. Two values of H give two jobs: the sync warm-up (10-step
    windows up to step 500) is cut to the job's share, so H=10 makes 6 rounds; H=25 makes 3, the
    last of them at step 60 after a window of 10 steps."""
    result = subprocess.run(
        [sys.executable, "run.py", "-m", "cluster.groups=1", "cluster.workers_per_group=1", "trainer.max_steps=60"]
        + ["trainer.eval_every=0", "algo.sync_every=0,10,25", f"hydra.sweep.dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    reason = "error: algo.sync_every=0: must be an integer >= 1"
    assert f"sweep job 0: {reason}" in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    at_end = next(i for i, line in enumerate(lines) if line.startswith("Error executing job with overrides"))
    assert lines[at_end + 1].startswith(reason), result.stderr  # hydra's last word: the first failure's reason
    names = []
    for job, h in (("1", 10), ("2", 25)):
        run = next((tmp_path / job / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
        name = f"algo.sync_every={h},cluster.groups=1,cluster.workers_per_group=1,trainer.eval_every=0,"
        name += "trainer.max_steps=60-group0"
        assert name.encode() in run, (job, name)  # the run's name, in wandb's own record of it
        assert f"diloco sweep {tmp_path}".encode() in run
        names.append(name)
    assert names[0] != names[1]
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert table[0] == "| job | overrides | ok | rounds | final eval loss | bytes/token | wall s |", table
    assert len(table) == 5, table
    assert table[2].startswith("| 0 | cluster.groups=1 cluster.workers_per_group=1 trainer.max_steps=60 ")
    assert table[2].endswith("algo.sync_every=0 | no | – | – | – | – |"), table
    assert "algo.sync_every=10 | yes | 6 |" in table[3] and "algo.sync_every=25 | yes | 3 |" in table[4], table
    assert f"sweep job 2: its row, with every job's so far, in {tmp_path / 'sweep.md'}" in result.stdout


def test_python_run_py_end_to_end_with_offline_wandb_then_eval_and_sample(tmp_path):
    """What a new user runs, shortened: the run directory holds everything the README promises,
    and role=eval / role=sample use the model it saved."""
    options = ["trainer.max_steps=40", "algo.sync_every=20", "trainer.eval_every=20"]

    def run(*more: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "run.py", *options, *more]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    result = run(f"hydra.run.dir={tmp_path}")
    assert "parameters" in result.stdout and result.stdout.count("done: eval loss") == 1, result.stdout
    transcript = (tmp_path / "run.log").read_text()  # the launcher's lines, with times
    for line in ("model: ", "step 40/40 ", "done: eval loss "):
        assert line in transcript, transcript
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("final_train_loss", "final_eval_loss", "tokens_seen", "wall_seconds", "tokens_per_s", "parameters"):
        assert key in summary, key
    assert summary["final_eval_loss"] < UNTRAINED_LOSS - 1.0
    assert summary["groups"] == 2 and summary["rounds"] >= 2 and summary["bytes_sent"] > 0
    # The header's planned rounds are the job's; the last progress line and the done line give summary's tok/s.
    assert f"; {summary['rounds']} rounds of ~" in transcript and f"watch: run directory {tmp_path}, " in transcript
    lines = result.stdout.splitlines()
    (last,) = [line for line in lines if line.startswith("step 40/40 ")]
    done = lines[-1]
    assert (
        f"tok/s {summary['tokens_per_s'] / 1000:.1f}k " in last
        and f"({summary['tokens_per_s'] / 1000:.1f}k tok/s" in done
    )
    assert f"{summary['syncs_committed']}/{summary['syncs_attempted']} syncs committed; no faults" in done, done
    assert len({g["digest"] for g in summary["per_group"]}) == 1
    assert (tmp_path / "config.yaml").read_text().startswith("model:")
    assert summary["model_sha256"] == hashlib.sha256((tmp_path / "model.pt").read_bytes()).hexdigest()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2, list(tmp_path.rglob("*"))  # one wandb run per group, grouped by job

    # The model's shape comes from the run's config.yaml, not from the command line's model=mini.
    evaluated = run("role=eval", f"checkpoint={tmp_path}", "model=mini", f"hydra.run.dir={tmp_path / 'eval'}")
    record = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert record["eval_loss"] == pytest.approx(summary["final_eval_loss"], abs=1e-4), evaluated.stdout
    assert f"eval loss {record['eval_loss']:.4f}" in evaluated.stdout
    prompt = ["sample.prompt='def main('", "sample.max_new_tokens=20", f"hydra.run.dir={tmp_path / 'sample'}"]
    sampled = run("role=sample", f"checkpoint={tmp_path / 'model.pt'}", *prompt).stdout
    assert sampled.startswith("def main(") and len(sampled.encode()) > len("def main(") + 20, sampled
