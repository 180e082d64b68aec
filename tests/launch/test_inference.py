"""role=eval and role=sample: loading a saved model, its loss on held-out windows, text from a prompt."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from diloco.config.base import ConfigError
from diloco.config.data import DataConfig
from diloco.config.job import JobConfig
from diloco.config.model import ModelConfig
from diloco.config.sample import SampleConfig
from diloco.launch.inference import (
    evaluate_checkpoint,
    generate,
    load_model,
    locate_weights,
    mean_loss,
    sample_text,
    text_tokenizer,
)
from diloco.launch.summary import model_sha256
from diloco.run_paths import RunPaths
from diloco.train.data import ByteTokenizer, eval_batches, load_corpus
from diloco.train.model import Transformer
from tests.conftest import compose_job

CPU = torch.device("cpu")
SMALL = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=16)


def trained_with(cfg: ModelConfig) -> JobConfig:
    return dataclasses.replace(JobConfig(), model=cfg)


def saved_model(tmp_path, cfg: ModelConfig = SMALL, seed: int = 0) -> tuple[Transformer, object]:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    return model.eval(), path


def test_greedy_sampling_is_top_k_1_and_runs_past_the_models_context(tmp_path):
    model, _ = saved_model(tmp_path)
    prompt = ByteTokenizer().encode("def f(x):")  # 9 tokens; 30 more run past max_seq_len=16
    greedy = generate(model, prompt, SampleConfig(max_new_tokens=30, temperature=0.0), CPU)
    top1 = generate(model, prompt, SampleConfig(max_new_tokens=30, temperature=1.7, top_k=1, seed=5), CPU)
    assert greedy.shape == (30,) and torch.equal(greedy, top1)
    window = torch.cat([prompt, greedy])[-SMALL.max_seq_len - 1 : -1].view(1, -1)
    assert int(greedy[-1]) == int(model(window)[0, -1].argmax()), "the last token sees only max_seq_len tokens back"


@pytest.mark.slow  # trains and samples a model (~5 s)
def test_sampling_is_seeded_and_top_k_limits_the_choice(tmp_path):
    model, _ = saved_model(tmp_path)
    prompt = ByteTokenizer().encode("x")
    cfg = SampleConfig(max_new_tokens=40, temperature=5.0, top_k=3, seed=1)
    first, again = generate(model, prompt, cfg, CPU), generate(model, prompt, cfg, CPU)
    assert torch.equal(first, again)
    assert not torch.equal(first, generate(model, prompt, dataclasses.replace(cfg, seed=2), CPU))
    ids = torch.cat([prompt, first])
    for i in range(len(prompt), len(ids)):
        likeliest = model(ids[max(0, i - SMALL.max_seq_len) : i].view(1, -1))[0, -1].topk(3).indices.tolist()
        assert int(ids[i]) in likeliest, (i, int(ids[i]), likeliest)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompt": ""}, "sample.prompt='': must not be empty"),
        ({"max_new_tokens": 0}, "sample.max_new_tokens=0: must be at least 1"),
        ({"temperature": -1.0}, "sample.temperature=-1.0: must be >= 0"),
        ({"top_k": -2}, "sample.top_k=-2: must be >= 0"),
    ],
)
def test_bad_sample_options_are_refused_by_name(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        dataclasses.replace(SampleConfig(), **change).validate()


def test_a_checkpoint_that_is_missing_corrupt_or_of_another_shape_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint=None: required"):
        locate_weights(None)
    with pytest.raises(ConfigError, match="holds no model.pt"):
        locate_weights(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        locate_weights(str(tmp_path / "nothing.pt"))
    _, path = saved_model(tmp_path)
    assert locate_weights(str(tmp_path)) == (path, tmp_path) == locate_weights(str(path))
    with pytest.raises(ConfigError, match="does not fit a model of dim 64, 1 layers"):
        load_model(path, trained_with(dataclasses.replace(SMALL, dim=64)), CPU)
    path.write_bytes(path.read_bytes()[:100])  # torn
    with pytest.raises(ConfigError, match="not a loadable model file"):
        load_model(path, trained_with(SMALL), CPU)


class _NotATensor:
    """What a pickled model.pt may hold beside tensors, and weights_only refuses."""


def _one_line_without_unpickling_advice(refused: pytest.ExceptionInfo) -> str:
    message = str(refused.value)
    assert "\n" not in message and "weights_only" not in message and "unpickl" not in message.lower()
    return message


def test_a_file_that_is_no_model_is_refused_in_one_line_without_unpickling_advice(tmp_path):
    """Once torch's six lines suggesting weights_only=False, and a summary.json called "corrupt"."""
    _, path = saved_model(tmp_path)
    run_files = {"summary.json": json.dumps({"model_sha256": model_sha256(RunPaths(tmp_path))}), "notes.txt": "hi"}
    for name, text in run_files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "empty.pt").write_bytes(b"")
    for name, why in [
        ("summary.json", "does not start like one"),
        ("notes.txt", "does not start like one"),
        ("empty.pt", "it is empty"),
    ]:
        with pytest.raises(ConfigError) as refused:
            locate_weights(str(tmp_path / name))
        message = _one_line_without_unpickling_advice(refused)
        assert message.startswith(f"checkpoint={tmp_path / name}: {tmp_path / name} is not a model file (")
        assert why in message and "a finished run's directory, its model.pt, or a checkpoint" in message
    # its first byte flipped: with the summary.json beside it, altered since its job wrote it; without, no model
    flipped = bytearray(path.read_bytes())
    flipped[0] ^= 0xFF
    path.write_bytes(flipped)
    with pytest.raises(ConfigError, match="corrupt or altered since its job wrote it"):
        locate_weights(str(tmp_path))
    (tmp_path / "summary.json").unlink()
    with pytest.raises(ConfigError) as refused:
        locate_weights(str(tmp_path))
    assert _one_line_without_unpickling_advice(refused) == (
        f"checkpoint={tmp_path}: {path} is not a loadable model file (torch.save writes a zip archive, and this "
        "file does not start like one); use an intact copy of the run's model.pt"
    )
    with pytest.raises(ConfigError) as refused:
        load_model(path, trained_with(SMALL), CPU)  # past locate_weights: torch.load's refusal, in one line
    assert "not a loadable model file" in _one_line_without_unpickling_advice(refused)
    torch.save({"output.weight": _NotATensor()}, path)  # a real zip archive, holding more than tensors
    with pytest.raises(ConfigError) as refused:
        load_model(path, trained_with(SMALL), CPU)
    message = _one_line_without_unpickling_advice(refused)
    assert message == (
        f"checkpoint={path}: not a loadable model file (damaged, or holds more than tensors); "
        "use an intact copy of the run's model.pt"
    )


def test_a_model_altered_since_its_job_recorded_it_is_refused_and_an_intact_one_loads(tmp_path):
    """A flipped bit in a tensor still loads, as a slightly different model: only the recorded sha256 tells."""
    model, path = saved_model(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"model_sha256": model_sha256(RunPaths(tmp_path))}))
    assert torch.equal(load_model(path, trained_with(SMALL), CPU).output.weight, model.output.weight)
    flipped = bytearray(path.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    path.write_bytes(flipped)
    with pytest.raises(ConfigError, match=r"model.pt: corrupt or altered since its job wrote it .*summary.json"):
        load_model(path, trained_with(SMALL), CPU)
    (tmp_path / "summary.json").write_text(json.dumps({"ok": False}))  # a run from before model_sha256: no check
    load_model(path, trained_with(SMALL), CPU)


def test_sampling_a_model_of_a_token_file_without_metadata_is_refused(tmp_path):
    """No tokens.json beside the ids: no tokenizer to speak text with (a prepared corpus has one:
    tests/prepare/test_prepare.py samples from it)."""
    data = DataConfig(corpus="tokens", path=str(tmp_path / "train.bin"), vocab_size=50304)
    trained = dataclasses.replace(JobConfig(), model=dataclasses.replace(SMALL, vocab_size=50304), data=data)
    with pytest.raises(
        ConfigError, match=r"data.path=.*train.bin': the model was trained on this token file, which has no tokens.json"
    ):
        text_tokenizer(trained)
    assert isinstance(text_tokenizer(trained_with(SMALL)), ByteTokenizer)  # stdlib: bytes


@pytest.mark.slow  # trains and evaluates a model (~2 s)
def test_eval_of_a_saved_model_is_its_mean_loss_on_the_groups_eval_windows(tmp_path):
    job = compose_job(["trainer.seq_len=16", "trainer.batch_size=2", "trainer.eval_batches=3"])
    cfg = dataclasses.replace(SMALL, vocab_size=job.data.vocab_size)
    model, path = saved_model(tmp_path, cfg)
    record = evaluate_checkpoint(job, path, trained_with(cfg))
    windows = eval_batches(load_corpus(job.data).val, seq_len=16, batch_size=2, max_batches=3, worker=0, num_workers=2)
    windows += eval_batches(load_corpus(job.data).val, seq_len=16, batch_size=2, max_batches=3, worker=1, num_workers=2)
    assert record["tokens"] == 2 * 2 * 3 * 16  # batch_size x workers_per_group x eval_batches x seq_len
    assert record["eval_loss"] == pytest.approx(mean_loss(model, windows, CPU), rel=1e-6)
    assert record["eval_ppl"] == pytest.approx(math.exp(record["eval_loss"]))
    text = sample_text(
        dataclasses.replace(job, sample=SampleConfig(prompt="import ", max_new_tokens=5)), path, trained_with(cfg)
    )
    assert text.startswith("import ")
