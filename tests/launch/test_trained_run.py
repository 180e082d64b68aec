"""role=eval, role=sample and role=export read the data and windows of the run that trained the
model; a setting the command line gives instead wins, is said in one line and recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.config.base import ConfigError
from diloco.config.data import DataConfig
from diloco.config.job import job_config_from_dict
from diloco.launch.compose import load_saved_config, to_yaml
from diloco.launch.inference import mean_loss
from diloco.launch.roles import as_resolved, use_trained_model
from diloco.launch.trained_run import command_line_settings, override_keys, with_run_settings
from diloco.run_paths import RunPaths
from diloco.train.data import eval_batches, load_corpus
from diloco.train.model import Transformer
from tests.config.test_tokens_meta import prepared
from tests.conftest import REPO, compose_raw_quickly

CPU = torch.device("cpu")
# The run's non-default settings: its corpus, its split, its windows.
RUN_OPTIONS = ["trainer.seq_len=16", "trainer.batch_size=2", "trainer.eval_batches=2", "data.val_fraction=0.2"]
SMALL = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.max_seq_len=16"]


def canned_text_run(root: Path) -> Path:
    """A run directory as a job on a text corpus leaves it: config.yaml (resolved, as run_role
    writes it), model.pt, and summary.json with the eval loss its groups measured on their windows."""
    corpus = root / "functions.py"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    raw = compose_raw_quickly(["data=text", f"data.path={corpus}", *RUN_OPTIONS, *SMALL, "cluster.workers_per_group=1"])
    job = job_config_from_dict(raw)
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(as_resolved(raw, job)))
    torch.manual_seed(0)
    torch.save(Transformer(job.model).state_dict(), run / "model.pt")
    (run / "summary.json").write_text(json.dumps({"ok": True, "final_eval_loss": loss_on(run, corpus)}))
    return run


def loss_on(run: Path, text: Path) -> float:
    """The loss of the run's model on the run's eval windows of ``text``."""
    model = Transformer(job_config_from_dict(load_saved_config(run / "config.yaml")).model)
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    held_out = load_corpus(DataConfig(corpus="text", path=str(text), val_fraction=0.2)).val
    windows = eval_batches(held_out, seq_len=16, batch_size=2, max_batches=2, worker=0, num_workers=1)
    return mean_loss(model.eval(), windows, CPU)


def use(out: Path, *overrides: str) -> dict | None:
    """What ``python run.py *overrides`` does for role=eval/sample/export, in this process; eval's record."""
    raw = compose_raw_quickly(list(overrides))
    out.mkdir()
    use_trained_model(job_config_from_dict(raw), RunPaths(out), raw, override_keys(overrides))
    return json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else None


def test_eval_with_no_data_options_scores_the_runs_data_and_windows(tmp_path, capsys):
    run = canned_text_run(tmp_path)
    record = use(tmp_path / "eval", "role=eval", f"checkpoint={run}")
    summary = json.loads((run / "summary.json").read_text())
    assert record["eval_loss"] == pytest.approx(summary["final_eval_loss"], rel=1e-6)
    data = record["data"]
    assert (data["corpus"], data["path"], data["val_fraction"]) == ("text", str(tmp_path / "functions.py"), 0.2)
    assert (record["seq_len"], record["batches"], record["sequences_per_batch"], record["tokens"]) == (16, 2, 2, 64)
    assert record["run_dir"] == str(run) and record["from_command_line"] == []
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and said[0].endswith(f"recorded in {tmp_path / 'eval' / 'eval.json'}"), said
    assert f"tokens of data=text data.path={tmp_path / 'functions.py'};" in said[0]


@pytest.mark.slow  # trains on a corpus (~3 s)
def test_a_corpus_on_the_command_line_wins_is_said_and_recorded(tmp_path, capsys):
    run = canned_text_run(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    record = use(tmp_path / "eval", "role=eval", f"checkpoint={run}", "data=text", f"data.path={other}")
    assert record["data"]["path"] == str(other) and record["data"]["val_fraction"] == 0.2, "the run's split stays"
    assert record["from_command_line"] == ["data.corpus", "data.path", "data.token_dtype", "data.vocab_size"]
    assert record["eval_loss"] == pytest.approx(loss_on(run, other), rel=1e-6)
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (
        f"scoring data.path={other} (command line) instead of the run's data.path={tmp_path / 'functions.py'}"
    )

    trainer = ["trainer=default", "trainer.seq_len=8", "trainer.eval_batches=1"]  # the defaults' batch_size, 8
    record = use(tmp_path / "eval2", "role=eval", f"checkpoint={run}", *trainer)
    assert (record["seq_len"], record["batches"], record["sequences_per_batch"]) == (8, 1, 8)
    assert "trainer.seq_len" in record["from_command_line"] and "data.path" not in record["from_command_line"]


def test_a_window_longer_than_the_models_context_is_refused_by_name(tmp_path):
    run = canned_text_run(tmp_path)
    with pytest.raises(ConfigError, match="trainer.seq_len=64: exceeds model.max_seq_len=16"):
        use(tmp_path / "eval", "role=eval", f"checkpoint={run}", "trainer.seq_len=64")


@pytest.mark.slow  # trains, samples and exports (~2 s)
def test_sample_and_export_read_the_runs_data(tmp_path, capsys):
    """A byte-level run: sampling speaks bytes without data options; an override is said on stderr,
    so stdout stays the text."""
    run = canned_text_run(tmp_path)
    use(tmp_path / "sample", "role=sample", f"checkpoint={run}", "sample.prompt=def", "sample.max_new_tokens=4")
    said = capsys.readouterr()
    assert said.out.startswith("def") and not said.err
    use(tmp_path / "sample2", "role=sample", f"checkpoint={run}", "data=stdlib", "sample.max_new_tokens=2")
    said = capsys.readouterr()
    assert said.err.startswith("sampling through the tokenizer of data=stdlib data.path=null (command line)")
    use(tmp_path / "export", "role=export", f"checkpoint={run}")
    assert json.loads((tmp_path / "export" / "hf" / "config.json").read_text())["vocab_size"] == 256


def test_a_prepared_corpus_named_instead_decides_its_vocabulary_a_bare_token_file_keeps_the_runs(tmp_path):
    trained = job_config_from_dict(compose_raw_quickly(["data=tokens", f"data.path={prepared(tmp_path / 'a')}"]))
    other, bare = prepared(tmp_path / "b", vocab_size=800), tmp_path / "bare.bin"
    bare.write_bytes(bytes(4096))
    for path, vocab_size in [(other, 800), (bare, 1000)]:
        overrides = ["role=eval", f"data.path={path}"]
        used, given = with_run_settings(compose_raw_quickly(overrides), trained, override_keys(overrides), "eval")
        assert (used.data.corpus, used.data.vocab_size, used.model.vocab_size) == ("tokens", vocab_size, 1000)
        assert given == ["data.path"]


def test_which_settings_the_command_line_set():
    keys = override_keys(["role=eval", "data=tokens", "+model.vocab_size=8", "~trainer.resume", "trainer=default"])
    assert keys == {"role", "data", "model.vocab_size", "trainer.resume", "trainer"}
    settings = ("data", "trainer.seq_len", "trainer.eval_batches", "parallel")
    given = command_line_settings(["data.path", "trainer", "parallel.tp", "model.dim"], settings)
    assert given == ["data.path", "parallel.tp", "trainer.eval_batches", "trainer.seq_len"]


@pytest.mark.slow  # two real python + hydra + torch starts (~4 s each)
def test_run_py_eval_hands_the_command_lines_keys_over(tmp_path):
    run = canned_text_run(tmp_path)

    def eval_json(out: str, *args: str) -> dict:
        command = [sys.executable, "run.py", "role=eval", f"checkpoint={run}", f"hydra.run.dir={tmp_path / out}", *args]
        result = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"recorded in {tmp_path / out / 'eval.json'}" in result.stdout, result.stdout
        return json.loads((tmp_path / out / "eval.json").read_text())

    assert eval_json("own")["data"]["path"] == str(tmp_path / "functions.py")
    assert eval_json("mine", "trainer.eval_batches=1", "model=mini")["from_command_line"] == ["trainer.eval_batches"]
