"""Hugging Face Llama checkpoints in (``model.init_from``) and out (``role=export``), held to
transformers' own ``LlamaForCausalLM``: equal logits within 1e-5 (fp32, CPU), tensors bit for bit.

transformers is an optional extra whose import alone takes seconds, so the tests that load it are
marked slow, as are the ones that run a job."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from diloco.config.job import job_config_from_dict
from diloco.config.model import ModelConfig
from diloco.launch.export import export_checkpoint
from diloco.launch.inference import locate_weights, read_weights
from diloco.launch.roles import trained_job_config
from diloco.train.hf_weights import load_pretrained
from diloco.train.model import Transformer
from tests.conftest import REPO
from tests.hf_checkpoints import VOCAB, handmade_llama, transformers_llama

TOKENS = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(0))  # past the original 64


def imported(folder) -> Transformer:
    """The model ``model.init_from=folder`` starts a job from."""
    cfg = job_config_from_dict({"model": {"init_from": str(folder)}}).model
    model = Transformer(cfg)
    load_pretrained(model, cfg)
    return model.eval()


def same_tensors(a_path, b_path) -> None:
    with safe_open(a_path, "pt") as a, safe_open(b_path, "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


@pytest.mark.parametrize("tie", [False, True])
def test_import_then_export_gives_back_the_same_tensors_bit_for_bit(tmp_path, tie):
    """Without transformers: the checkpoint is this project's random model in transformers' layout."""
    base = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_hidden_dim=96)
    source = handmade_llama(tmp_path / "source", dataclasses.replace(base, tie_embeddings=tie))
    torch.save(imported(source).state_dict(), tmp_path / "model.pt")
    trained = job_config_from_dict({"model": {"init_from": str(source)}})
    out = export_checkpoint(tmp_path / "model.pt", trained, tmp_path / "hf")
    same_tensors(source / "model.safetensors", out / "model.safetensors")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) != tie
    assert imported(out).cfg == dataclasses.replace(trained.model, init_from=str(out))


def test_the_export_of_a_run_on_a_prepared_corpus_carries_its_tokenizer_and_eos(tmp_path):
    """The tokenizer files ``role=prepare`` saved beside the tokens, and the eos id it separated documents with."""
    from diloco.config.tokens_meta import CorpusMeta, TokenizerInfo

    corpus = tmp_path / "corpus"
    (corpus / "tokenizer").mkdir(parents=True)
    (corpus / "tokenizer" / "tokenizer.json").write_text('{"model": "stand-in"}')
    (corpus / "tokenizer" / "tokenizer_config.json").write_text("{}")
    (corpus / "tokens.bin").write_bytes(bytes(2 * 1000))
    info = TokenizerInfo(source="test", sha256="0" * 64, vocab_size=280, eos_id=7, eos_token="<eos>")
    meta = CorpusMeta(tokenizer=info, token_dtype="uint16", documents=1, tokens=1000, sources=(), text_field=None)
    (corpus / "tokens.json").write_text(json.dumps(meta.to_json()))
    source = handmade_llama(tmp_path / "source")
    torch.save(imported(source).state_dict(), tmp_path / "model.pt")
    data = {"corpus": "tokens", "path": str(corpus / "tokens.bin")}
    trained = job_config_from_dict({"model": {"init_from": str(source)}, "data": data})
    out = export_checkpoint(tmp_path / "model.pt", trained, tmp_path / "hf")
    assert (out / "tokenizer.json").read_text() == '{"model": "stand-in"}' and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 7
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 7}


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_an_imported_transformers_llama_gives_its_logits_and_exports_back_bit_for_bit(tmp_path, tie):
    pytest.importorskip("transformers")
    theirs = transformers_llama(tmp_path / "hf", tie=tie)
    ours = imported(tmp_path / "hf")
    assert ours.cfg.rope_scaling == "llama3" and ours.cfg.n_kv_heads == 2 and ours.cfg.tie_embeddings == tie
    with torch.no_grad():
        torch.testing.assert_close(ours(TOKENS), theirs(TOKENS).logits, rtol=0, atol=1e-5)
    torch.save(ours.state_dict(), tmp_path / "model.pt")
    trained = job_config_from_dict({"model": {"init_from": str(tmp_path / "hf")}})
    out = export_checkpoint(tmp_path / "model.pt", trained, tmp_path / "out")
    same_tensors(tmp_path / "hf" / "model.safetensors", out / "model.safetensors")


@pytest.mark.slow
def test_a_sharded_checkpoint_loads(tmp_path):
    pytest.importorskip("transformers")
    theirs = transformers_llama(tmp_path / "hf", tie=False, max_shard_size="100KB")
    assert len(list((tmp_path / "hf").glob("model-0000*-of-0000*.safetensors"))) > 1
    with torch.no_grad():
        torch.testing.assert_close(imported(tmp_path / "hf")(TOKENS), theirs(TOKENS).logits, rtol=0, atol=1e-5)


def run_py(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "run.py", "logger=none", *args]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


JOB = ["algo=diloco", "cluster.groups=2", "trainer.max_steps=4", "algo.sync_every=2", "trainer.seq_len=64"]
JOB += ["trainer.batch_size=2", "trainer.eval_every=0", "trainer.eval_batches=1"]


@pytest.mark.slow
def test_a_diloco_job_from_a_llama_checkpoint_exports_to_transformers_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers_llama(tmp_path / "hf", tie=False)
    run_dir = tmp_path / "run"
    run_py(*JOB, "cluster.workers_per_group=1", f"model.init_from={tmp_path / 'hf'}", f"hydra.run.dir={run_dir}")
    (tmp_path / "hf").rename(tmp_path / "moved")  # the run's config.yaml keeps the shape config.json gave
    result = run_py("role=export", f"checkpoint={run_dir}", f"hydra.run.dir={tmp_path / 'export'}")
    out = tmp_path / "export" / "hf"
    assert f"exported {run_dir / 'model.pt'} to {out}" in result.stdout
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    trained = trained_job_config(run_dir, job_config_from_dict({}))
    ours = Transformer(trained.model)
    ours.load_state_dict(read_weights(run_dir / "model.pt", trained))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, ours.eval()(TOKENS), rtol=0, atol=1e-5)
    source = imported(tmp_path / "moved")
    assert not torch.equal(source.layers["0"].attention.wq.weight, ours.layers["0"].attention.wq.weight)  # it trained


@pytest.mark.slow
def test_every_group_and_its_outer_state_start_from_the_checkpoint_when_sharded(tmp_path):
    """With inner steps of 1e-9 the job ends where it started only if θ_l of every worker and θ_g
    both began at the pretrained weights: a θ_g left random would pull the model far away. The
    export of its sharded training checkpoint (FSDP2 over 2 workers) gives the same weights back.
    Each worker loads the whole model before it is sharded, so a tensor-parallel cut of it is the
    same path as that of a random model (tests/test_tensor_parallel.py)."""
    source = handmade_llama(tmp_path / "hf")
    run_dir = tmp_path / "run"
    tiny_steps = ["inner_opt.lr=1e-9", "inner_opt.warmup_steps=0", "trainer.checkpoint.every=4"]
    run_py(
        *JOB,
        *tiny_steps,
        "cluster.workers_per_group=2",
        f"model.init_from={source}",
        f"hydra.run.dir={run_dir}",
    )
    trained = trained_job_config(run_dir, job_config_from_dict({}))
    final = read_weights(run_dir / "model.pt", trained)
    for name, value in imported(source).state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-6, msg=name)
    weights, _ = locate_weights(str(run_dir / "checkpoints" / "step-000004"))
    out = export_checkpoint(weights, trained, tmp_path / "out")
    with safe_open(source / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        for name in a.keys():
            torch.testing.assert_close(b.get_tensor(name), a.get_tensor(name), rtol=0, atol=1e-6, msg=name)
