"""``model.init_from``'s config.json: the shape it sets, what it overrides, and what it refuses (one line each)."""

from __future__ import annotations

import json

import pytest

from diloco.config.base import ConfigError
from diloco.config.hf_llama import hf_config, pretrained_model_keys
from diloco.config.job import job_config_from_dict
from diloco.config.model import ModelConfig
from tests.hf_checkpoints import LLAMA3_SCALING, VOCAB, handmade_llama


def test_config_json_sets_shape_vocabulary_and_rope_over_the_preset(tmp_path):
    folder = handmade_llama(tmp_path / "hf", rope_scaling=dict(LLAMA3_SCALING), max_position_embeddings=512)
    job = job_config_from_dict({"model": {"init_from": str(folder), "dim": 64, "n_layers": 2}})
    m = job.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (64, 2, 4, 2, 96, VOCAB)
    assert (m.max_seq_len, m.rope_scaling, m.rope_factor, m.rope_original_max_seq_len) == (512, "llama3", 8.0, 64)
    assert job.data.vocab_size == 256  # the byte corpus's ids fit the model's larger table


def test_both_config_json_dialects_read_alike(tmp_path):
    """transformers 4.x writes rope_theta + rope_scaling, 5.x rope_parameters."""
    v4 = handmade_llama(tmp_path / "v4", rope_theta=10000.0, rope_scaling={**LLAMA3_SCALING})
    v5 = handmade_llama(tmp_path / "v5", rope_parameters={**LLAMA3_SCALING, "rope_theta": 10000.0})
    assert pretrained_model_keys(str(v4)) == pretrained_model_keys(str(v5))
    assert pretrained_model_keys(str(v4))["rope_theta"] == 10000.0


def test_export_config_reads_back_as_the_same_model(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, tie_embeddings=True, rope_scaling="llama3", rope_original_max_seq_len=64)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(cfg, "float32")))
    (folder / "model.safetensors").write_bytes(b"")  # only its presence is checked here
    keys = pretrained_model_keys(str(folder))
    assert all(getattr(cfg, key) == value for key, value in keys.items() if key != "ffn_hidden_dim")
    assert keys["ffn_hidden_dim"] == cfg.ffn_dim


def test_a_command_line_key_that_disagrees_is_refused_naming_both(tmp_path):
    folder = handmade_llama(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"model\.dim=128 conflicts with .*config\.json, which gives 64"):
        job_config_from_dict({"model": {"init_from": str(folder), "dim": 128}})
    with pytest.raises(ConfigError, match=r"model\.vocab_size=256 conflicts"):
        job_config_from_dict({"model": {"init_from": str(folder), "vocab_size": 256}})


BAD_CONFIGS = [
    ({"model_type": "gpt2"}, "model_type is 'gpt2', not 'llama'"),
    ({"head_dim": 32}, "head_dim=32 is not hidden_size/num_attention_heads=64/4"),
    ({"attention_bias": True}, "sets attention_bias=true"),
    ({"mlp_bias": True}, "sets mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 RoPE scaling lacks low_freq_factor"),
]


@pytest.mark.parametrize("change,message", BAD_CONFIGS, ids=[m.split()[0] for _, m in BAD_CONFIGS])
def test_a_config_json_this_model_cannot_be_is_refused_in_one_line(tmp_path, change, message):
    folder = handmade_llama(tmp_path / "hf", **change)
    with pytest.raises(ConfigError, match="model.init_from=") as refused:
        job_config_from_dict({"model": {"init_from": str(folder)}})
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_missing_files_are_refused_naming_path_and_fix(tmp_path):
    def refused(folder) -> str:
        with pytest.raises(ConfigError) as error:
            job_config_from_dict({"model": {"init_from": str(folder)}})
        return str(error.value)

    assert "is not a directory" in refused(tmp_path / "nowhere")
    folder = handmade_llama(tmp_path / "hf")
    (folder / "model.safetensors").unlink()
    assert f"model.init_from={folder}: holds neither model.safetensors" in refused(folder)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "names model-00002-of-00002.safetensors, which is not there" in refused(folder)
    (folder / "config.json").unlink()
    assert "has no config.json; point it at a Hugging Face Llama directory" in refused(folder)
