"""Planned stop and resume (diloco/train/checkpoint.py, worker_state.py): files refused by name when
partial or corrupt, the resume source chosen as documented, and with real processes a resumed
job equal bit for bit to an uninterrupted one, and Ctrl-C keeping summary, model and checkpoint."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.config.base import ConfigError
from diloco.launch.inference import locate_weights, read_weights
from diloco.launch.launcher import launch, pin_resume
from diloco.launch.local_cluster import JobFailed, wait_until
from diloco.run_paths import RunPaths
from diloco.train.checkpoint import (
    COMPLETE,
    STATE,
    CheckpointError,
    check_compatible,
    check_rank,
    describe_resume,
    group_dir,
    load_rank,
    mark_complete,
    rank_dir,
    resolve_resume,
    save_rank,
    step_dir,
)
from diloco.train.logger import read_jsonl
from diloco.train.model import meta_model, param_signature
from diloco.worker.builders import checkpoint_identity, preflight
from tests.conftest import REPO, compose_job

TENSORS = {"model.w": torch.arange(6.0).view(2, 3), "inner.0.step": torch.tensor(7.0)}


def _save_group(run_dir: Path, group: int, step: int, workers: int = 1, info: dict | None = None) -> Path:
    folder = group_dir(step_dir(run_dir, step), group)
    for rank in range(workers):
        save_rank(rank_dir(folder, rank), {k: v + rank for k, v in TENSORS.items()}, {"step": step, "rank": rank})
    mark_complete(folder, {"step": step, "committed": step // 10} | (info or {}))
    return folder


def test_a_rank_saved_is_loaded_exactly_with_its_progress(tmp_path):
    folder = _save_group(tmp_path, 0, 20, workers=2)
    template = {k: torch.zeros_like(v) for k, v in TENSORS.items()}
    loaded, progress = load_rank(rank_dir(folder, 1), template)
    assert progress == {"step": 20, "rank": 1}
    for name, tensor in TENSORS.items():
        assert torch.equal(loaded[name], tensor + 1)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in template.values()), "the template is left untouched"


def test_a_corrupt_or_partial_checkpoint_is_refused_naming_the_file(tmp_path):
    """The launcher's check reads sizes and the header (a truncated or re-laid file); an altered
    byte of a tensor is the worker's load's to refuse, by the sha256 it takes as it reads."""
    folder = _save_group(tmp_path, 0, 20)
    template = {k: torch.zeros_like(v) for k, v in TENSORS.items()}
    shard = rank_dir(folder, 0) / STATE
    good = shard.read_bytes()
    data = bytearray(good)
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    check_rank(rank_dir(folder, 0))
    with pytest.raises(CheckpointError, match=rf"{shard}: corrupt"):
        load_rank(rank_dir(folder, 0), template)
    relaid = good.replace(b'"shape":[2,3]', b'"shape":[3,2]')
    assert relaid != good
    shard.write_bytes(relaid)
    with pytest.raises(CheckpointError, match=rf"{shard}: corrupt \(its size or sha256 differs"):
        check_rank(rank_dir(folder, 0))
    shard.write_bytes(good[:-4])
    with pytest.raises(CheckpointError, match=rf"{shard}: corrupt \(its size or sha256 differs"):
        check_rank(rank_dir(folder, 0))
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard}: missing"):
        load_rank(rank_dir(folder, 0), template)
    (rank_dir(folder, 0) / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json: missing; the checkpoint is partial"):
        load_rank(rank_dir(folder, 0), template)


def test_a_checkpoint_of_other_state_is_refused(tmp_path):
    folder = _save_group(tmp_path, 0, 20)
    with pytest.raises(CheckpointError, match="holds other state than this job's workers"):
        load_rank(rank_dir(folder, 0), {"model.w": torch.zeros(2, 3)})
    other_shape = {"model.w": torch.zeros(3, 2), "inner.0.step": torch.tensor(0.0)}
    with pytest.raises(
        CheckpointError, match=r"tensor model.w is torch.float32 \[2, 3\], this job's torch.float32 \[3, 2\]"
    ):
        load_rank(rank_dir(folder, 0), other_shape)
    manifest_path = rank_dir(folder, 0) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"] = {"__0_0.distcp": manifest["files"][STATE]}  # as the earlier format listed its files
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="names no state.safetensors, so it is of an earlier format"):
        load_rank(rank_dir(folder, 0), other_shape)
    check_compatible(folder, {"step": 20})
    with pytest.raises(CheckpointError, match=r"written with step=20, this job has 30"):
        check_compatible(folder, {"step": 30})


def test_resuming_on_other_data_is_refused_before_any_process_starts(tmp_path):
    """Other data, windows or seed would make the saved read position mean other windows: the
    launcher refuses it, instead of starting workers that each refuse it and get restarted."""
    saved = compose_job(["logger=none", "cluster.workers_per_group=1"])
    signature = param_signature(saved.model, meta_model(saved.model))
    run = tmp_path / "saved"
    for group in range(saved.cluster.groups):
        _save_group(run, group, 20, info=checkpoint_identity(saved, signature, 1))
    resume = ["logger=none", "cluster.workers_per_group=1", f"trainer.resume={step_dir(run, 20)}"]
    preflight(compose_job(resume), RunPaths(tmp_path / "same"))
    for other, key in [("data.val_fraction=0.1", "windows_per_group"), ("trainer.seq_len=64", "windows_per_group")]:
        with pytest.raises(CheckpointError, match=f"written with {key}="):
            preflight(compose_job([*resume, other]), RunPaths(tmp_path / "other"))
    with pytest.raises(CheckpointError, match="written with data_seed=0, this job has 1"):
        preflight(compose_job([*resume, "trainer.seed=1"]), RunPaths(tmp_path / "other"))


def test_resuming_with_another_model_names_the_model_keys_that_differ(tmp_path):
    """Not two signatures' hashes: the keys a user changed, with both values. A checkpoint from
    before the model was recorded still has its signature compared."""
    saved = compose_job(["logger=none", "cluster.workers_per_group=1"])
    identity = checkpoint_identity(saved, param_signature(saved.model, meta_model(saved.model)), 1)
    run, older = tmp_path / "saved", tmp_path / "older"
    for group in range(saved.cluster.groups):
        _save_group(run, group, 20, info=identity)
        _save_group(older, group, 20, info={k: v for k, v in identity.items() if k != "model"})
    resume = ["logger=none", "cluster.workers_per_group=1", f"trainer.resume={step_dir(run, 20)}"]
    preflight(compose_job(resume), RunPaths(tmp_path / "same"))
    with pytest.raises(CheckpointError) as refused:
        preflight(compose_job([*resume, "model.dim=32", "model.n_heads=2"]), RunPaths(tmp_path / "other"))
    assert f"written with model.dim={saved.model.dim}, this job has 32; model.n_heads={saved.model.n_heads}, " in str(
        refused.value
    ) and str(refused.value).endswith("this job has 2; resume with the configuration the checkpoint was written with")
    with pytest.raises(CheckpointError, match="written with signature="):
        preflight(
            compose_job(
                ["logger=none", "cluster.workers_per_group=1", "model.dim=32", "model.n_heads=2"]
                + [f"trainer.resume={step_dir(older, 20)}"]
            ),
            RunPaths(tmp_path / "o"),
        )


def test_resuming_with_another_inner_or_outer_optimizer_is_refused_before_any_process_starts(tmp_path):
    """Muon's state is a momentum buffer where AdamW's is two moments: workers that each refused
    the checkpoint's tensors were restarted until the job failed. A checkpoint recorded before the
    optimizers were is left to that check of its tensors."""
    saved = compose_job(["logger=none", "cluster.workers_per_group=1", "inner_opt=muon"])
    identity = checkpoint_identity(saved, param_signature(saved.model, meta_model(saved.model)), 1)
    run, older = tmp_path / "saved", tmp_path / "older"
    for group in range(saved.cluster.groups):
        _save_group(run, group, 20, info=identity)
        _save_group(older, group, 20, info={k: v for k, v in identity.items() if k not in ("inner_opt", "outer_opt")})
    resume = ["logger=none", "cluster.workers_per_group=1", f"trainer.resume={step_dir(run, 20)}"]
    preflight(compose_job([*resume, "inner_opt=muon"]), RunPaths(tmp_path / "same"))
    with pytest.raises(CheckpointError, match="written with inner_opt='muon', this job has 'adamw'"):
        preflight(compose_job(resume), RunPaths(tmp_path / "other"))
    with pytest.raises(CheckpointError, match="written with outer_opt='nesterov', this job has 'adam'"):
        preflight(compose_job([*resume, "inner_opt=muon", "outer_opt=adam"]), RunPaths(tmp_path / "other"))
    preflight(
        compose_job(["logger=none", "cluster.workers_per_group=1", f"trainer.resume={step_dir(older, 20)}"]),
        RunPaths(tmp_path / "o"),
    )


@pytest.mark.slow  # a job's workers start (~10 s)
def test_a_worker_that_refuses_the_checkpoint_fails_the_job_at_once_in_one_line(fast_job, tmp_path):
    """A checkpoint recorded as this job's whose tensors are another's passes the launcher's checks
    and is refused by the worker that loads it: the job fails on that refusal, in its one line,
    instead of restarting the group cluster.max_restarts times to the same refusal."""
    job = fast_job("cluster.workers_per_group=1")
    run = tmp_path / "saved"
    _save_group(run, 0, 10, info=checkpoint_identity(job, param_signature(job.model, meta_model(job.model)), 1))
    with pytest.raises(JobFailed) as failed:
        launch(fast_job("cluster.workers_per_group=1", f"trainer.resume={step_dir(run, 10)}"), tmp_path / "run")
    said = str(failed.value)
    assert said.startswith("group 0 rank 0 refused the job (a restart would too): "), said
    assert "holds other state than this job's workers" in said and "\n" not in said
    kinds = [e["kind"] for e in read_jsonl(RunPaths(tmp_path / "run").events)]
    assert "refused" in kinds and "restart" not in kinds and "crash" not in kinds, kinds


def test_resume_takes_each_groups_newest_whole_checkpoint_of_a_run(tmp_path):
    run = tmp_path / "outputs" / "day" / "run1"
    _save_group(run, 0, 20)
    _save_group(run, 1, 20)
    _save_group(run, 0, 40)
    group_dir(step_dir(run, 40), 1).mkdir(parents=True)  # group 1's step 40 never completed
    expected = {0: group_dir(step_dir(run, 40), 0), 1: group_dir(step_dir(run, 20), 1)}
    assert resolve_resume(str(run), tmp_path / "new", tmp_path, groups=2) == expected
    assert resolve_resume(str(step_dir(run, 20)), tmp_path / "new", tmp_path, 2) == {
        g: group_dir(step_dir(run, 20), g) for g in (0, 1)
    }
    with pytest.raises(CheckpointError, match="group 1's checkpoint is partial or absent"):
        resolve_resume(str(step_dir(run, 40)), tmp_path / "new", tmp_path, 2)
    with pytest.raises(CheckpointError, match="no whole checkpoint of group 2"):
        resolve_resume(str(run), tmp_path / "new", tmp_path, 3)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume(str(tmp_path / "nowhere"), tmp_path / "new", tmp_path, 2)


def test_resume_from_a_part_of_a_checkpoint_names_the_checkpoint_folder(tmp_path):
    """A worker's file was once "no such directory"; a checkpoint is a folder, so name it."""
    run = tmp_path / "run"
    for group in (0, 1):
        _save_group(run, group, 20)
    checkpoint = step_dir(run, 20)
    shard = rank_dir(group_dir(checkpoint, 0), 0) / STATE
    for part, what in [(shard, "a file of"), (group_dir(checkpoint, 1), "a folder inside")]:
        with pytest.raises(CheckpointError) as refused:
            resolve_resume(str(part), tmp_path / "new", tmp_path, 2)
        assert str(refused.value) == (
            f"trainer.resume={part}: {what} the checkpoint {checkpoint}; a checkpoint is a folder, so pass "
            f"trainer.resume={checkpoint}"
        )
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"notes\.txt: a file, not a checkpoint; a checkpoint is a folder"):
        resolve_resume(str(text), tmp_path / "new", tmp_path, 2)
    with pytest.raises(CheckpointError, match="group 0's checkpoint is partial or absent"):
        resolve_resume(str(tmp_path), tmp_path / "new", tmp_path, 2)  # a folder that holds no checkpoint


def test_eval_of_a_part_of_a_checkpoint_names_the_checkpoint_folder(tmp_path):
    """role=eval checkpoint= a worker's state.safetensors or its folder: the checkpoint folder is what it takes."""
    checkpoint = step_dir(tmp_path / "run", 20)
    folder = _save_group(tmp_path / "run", 0, 20)
    shard = rank_dir(folder, 0) / STATE
    for part, what in [(shard, "a file of"), (rank_dir(folder, 0), "a folder inside")]:
        with pytest.raises(ConfigError) as refused:
            locate_weights(str(part))
        assert str(refused.value) == (
            f"checkpoint={part}: {what} the checkpoint {checkpoint}; a checkpoint is a folder, so pass "
            f"checkpoint={checkpoint}"
        )
    assert locate_weights(str(checkpoint))[0] == folder


def test_resume_latest_is_the_run_with_the_newest_whole_checkpoint_but_this_one(tmp_path):
    outputs = tmp_path / "outputs"
    older, newer, this = outputs / "a" / "r1", outputs / "b" / "r2", outputs / "b" / "r3"
    for order, (run, step) in enumerate([(older, 90), (newer, 10), (this, 50)]):
        marker = _save_group(run, 0, step) / COMPLETE
        os.utime(marker, (1e9 + order, 1e9 + order))  # written in this order, whatever the clock's resolution
    assert resolve_resume("latest", this, outputs, 1) == {0: group_dir(step_dir(newer, 10), 0)}
    with pytest.raises(CheckpointError, match="trainer.resume=latest: no run under"):
        resolve_resume("latest", this, tmp_path / "empty", 1)


def test_resume_auto_starts_fresh_without_a_whole_checkpoint_and_else_resumes_as_latest(tmp_path):
    """One command line both starts a job and resumes it: the README's tour on a fresh clone."""
    outputs = tmp_path / "outputs"
    this = outputs / "b" / "r2"
    assert resolve_resume("auto", this, outputs, 1) is None  # no outputs folder at all
    assert describe_resume("auto", None, outputs) == (
        f"starting fresh: trainer.resume=auto found no whole checkpoint of an unfinished run under {outputs} "
        "(trainer.checkpoint.search_dir)"
    )
    group_dir(step_dir(outputs / "a" / "r0", 10), 0).mkdir(parents=True)  # never completed
    _save_group(this, 0, 30)  # this run's own
    assert resolve_resume("auto", this, outputs, 1) is None
    folder = _save_group(outputs / "a" / "r1", 0, 20)
    assert resolve_resume("auto", this, outputs, 1) == {0: folder}
    assert describe_resume("auto", {0: folder}, outputs) == (
        f"resuming (trainer.resume=auto): group 0 from {folder} (step 20, round 2)"
    )
    (outputs / "a" / "r1" / "summary.json").write_text('{"ok": false, "interrupted": true}')  # a planned stop
    assert resolve_resume("auto", this, outputs, 1) == {0: folder}
    (outputs / "a" / "r1" / "summary.json").write_text('{"ok": true}')  # it ended with its final model
    assert resolve_resume("auto", this, outputs, 1) is None, "a finished run has nothing left to train"
    assert resolve_resume("latest", this, outputs, 1) == {0: folder}, "latest trains it further"


def test_resume_auto_skips_a_stopped_run_that_a_later_run_resumed_and_finished(tmp_path):
    """Stop A, run the command again (it resumes A and finishes as B), run it a third time: nothing is
    left to train, through a chain of resumes too (C resumed B's checkpoint, B resumed A)."""
    outputs = tmp_path / "outputs"
    a, b, c, this = (outputs / name for name in ("a", "b", "c", "this"))
    _save_group(a, 0, 20)
    _save_group(b, 0, 40)
    for run, source in [(b, a), (c, step_dir(b, 40))]:
        run.mkdir(parents=True, exist_ok=True)
        (run / "job.json").write_text(json.dumps({"trainer": {"resume": str(source)}}))
    assert resolve_resume("auto", this, outputs, 1) == {0: group_dir(step_dir(b, 40), 0)}, "B stopped too"
    (c / "summary.json").write_text('{"ok": false}')  # C failed: B is still left to train
    assert resolve_resume("auto", this, outputs, 1) == {0: group_dir(step_dir(b, 40), 0)}
    (c / "summary.json").write_text('{"ok": true}')  # C ended with its final model: A's and B's steps with it
    assert resolve_resume("auto", this, outputs, 1) is None
    assert resolve_resume("latest", this, outputs, 1) == {0: group_dir(step_dir(b, 40), 0)}, "latest still can"


def test_the_launcher_resolves_auto_once_for_every_process_and_says_which(tmp_path):
    """Workers read the run it found (or none), not whatever run is newest when one restarts."""
    outputs = tmp_path / "outputs"
    job = compose_job(["logger=none", "trainer.resume=auto", f"trainer.checkpoint.search_dir={outputs}"])
    said = io.StringIO()
    assert pin_resume(job, RunPaths(outputs / "new"), said).trainer.resume == ""
    assert said.getvalue().startswith("starting fresh: trainer.resume=auto found no whole checkpoint of an unfinished")
    for group in (0, 1):
        _save_group(outputs / "old", group, 20)
    assert pin_resume(job, RunPaths(outputs / "new"), said).trainer.resume == str(outputs / "old")
    assert said.getvalue().splitlines()[-1].startswith("resuming (trainer.resume=auto): group 0 from ")


def test_checkpoint_every_must_fall_between_rounds():
    compose_job(["trainer.checkpoint.every=100", "algo.sync_every=50"]).validate()
    compose_job(["trainer.checkpoint.every=7", "algo=ddp"]).validate()
    with pytest.raises(ConfigError, match=r"trainer.checkpoint.every=75: must be a multiple of algo.sync_every=50"):
        compose_job(["trainer.checkpoint.every=75", "algo.sync_every=50"]).validate()
    with pytest.raises(ConfigError, match="trainer.checkpoint.every=-1"):
        compose_job(["trainer.checkpoint.every=-1"]).validate()


RESUMABLE = ["logger=none", "cluster.min_groups=2", "algo.sync_every=10", "trainer.eval_every=0"]
RESUMABLE += ["trainer.checkpoint.every=20", "trainer.max_steps=40"]
# H = 20 with windows of 10 up to step 20: rounds at 10, 20 and 40, the checkpoint where the warm-up ends.
SYNC_WARMUP = ["algo.sync_every=20", "algo.sync_warmup_every=10", "algo.sync_warmup_steps=20", "trainer.warmup_share=1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [[], ["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.pp=2"], ["inner_opt=muon"]],
    ids=["fsdp", "tp", "pp", "muon"],
)
def test_a_resumed_job_equals_the_uninterrupted_one_bit_for_bit(tmp_path, layout):
    """2 groups x 2 workers, FSDP2-sharded, tensor-parallel or in two pipeline stages: each worker
    saves and restores only its own shard (with inner_opt=muon, FSDP2: its momentum and Adam moments)."""
    whole = launch(compose_job([*RESUMABLE, *SYNC_WARMUP, *layout]), tmp_path / "whole")
    assert whole["ok"], whole["failure"]
    halfway = step_dir(tmp_path / "whole", 20)
    resumed = launch(
        compose_job([*RESUMABLE, *SYNC_WARMUP, *layout, f"trainer.resume={halfway}"]), tmp_path / "resumed"
    )
    assert resumed["ok"], resumed["failure"]
    digests = {r["digest"] for s in (whole, resumed) for r in s["per_group"]}
    assert len(digests) == 1, "θ_g and the outer state after the resume are the uninterrupted job's"
    assert resumed["final_eval_loss"] == whole["final_eval_loss"]
    assert resumed["tokens_seen"] == whole["tokens_seen"], "the tokens before the checkpoint still count"
    trained = resumed["tokens_per_s"] * resumed["train_seconds"]
    assert trained == pytest.approx(resumed["tokens_seen"] / 2), "its rate counts only the steps it trained"
    metrics = [json.loads(line) for line in (tmp_path / "resumed" / "metrics" / "group0.jsonl").open()]
    assert min(m["step"] for m in metrics) > 20, "the resumed job trained only the steps after the checkpoint"
    rounds = [r["inner_step"] for r in read_jsonl(RunPaths(tmp_path / "whole").commits(0)) if r["committed"]]
    assert rounds == [10, 20, 40], "windows of 10 through the warm-up, then of H = 20"
    weights, run_dir = locate_weights(str(step_dir(tmp_path / "whole", 40)))  # role=eval checkpoint=...
    assert run_dir == tmp_path / "whole"
    final = read_weights(
        weights, compose_job([*RESUMABLE, *SYNC_WARMUP, *layout])
    )  # group 0's two shards of θ_g, put together
    saved = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in saved)
    with pytest.raises(ConfigError, match="written with workers=2, this job has 1"):
        launch(compose_job([*RESUMABLE, "cluster.workers_per_group=1", f"trainer.resume={halfway}"]), tmp_path / "x")
    if layout and layout[0].startswith("parallel."):  # the same workers cut another way hold other shards
        key = layout[0].split("=")[0].removeprefix("parallel.")
        with pytest.raises(ConfigError, match=f"written with {key}=2, this job has 1"):
            launch(compose_job([*RESUMABLE, f"trainer.resume={halfway}"]), tmp_path / "y")


@pytest.mark.slow
def test_ctrl_c_keeps_summary_model_and_a_checkpoint_to_resume_from(tmp_path):
    run_dir = tmp_path / "run"
    args = ["logger=none", "cluster.workers_per_group=1", "algo.sync_every=10", "trainer.max_steps=80"]
    args += ["trainer.checkpoint.every=20", "trainer.eval_every=0"]
    launcher = subprocess.Popen(
        [sys.executable, "run.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        commits = RunPaths(run_dir).commits(0)
        wait_until(lambda: commits.exists() and len(commits.read_text().splitlines()) >= 3, 120, "two rounds", 0.2)
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, output
    assert "interrupted (planned stop): model.pt holds round" in output, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and not summary["ok"] and summary["steps"] < 80, summary
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    assert not list((run_dir / "results").glob("*.model.pt")), "only the newest group's model is kept, as model.pt"
    assert summary["model_sha256"] == hashlib.sha256((run_dir / "model.pt").read_bytes()).hexdigest()
    stopped_at = {r["group"]: r["steps"] for r in summary["per_group"]}
    for group, step in stopped_at.items():
        assert (group_dir(step_dir(run_dir, step), group) / "complete.json").exists(), "a stop checkpoint per group"

    resumed = subprocess.run(
        [sys.executable, "run.py", *args, f"trainer.resume={run_dir}", f"hydra.run.dir={tmp_path / 'resumed'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming: group 0 from" in resumed.stdout
    assert json.loads((tmp_path / "resumed" / "summary.json").read_text())["steps"] == 80
