"""Tiny Hugging Face Llama directories made in a test's tmp folder, with transformers or without it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diloco.config.hf_llama import hf_config
from diloco.config.model import ModelConfig
from diloco.train.hf_weights import hf_state_dict, save_safetensors
from diloco.train.model import Transformer

# GQA (4 query heads over 2 KV heads) and llama3 RoPE scaling whose three regimes all occur at
# head_dim 16: the fastest pair is kept, the next blended, the rest interpolated.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VOCAB = 300  # above the byte corpus's 256: the tokenizer's vocabulary need only fit the model's


def transformers_llama(folder: Path, tie: bool, max_shard_size: str | None = None, seed: int = 0):
    """A random ``LlamaForCausalLM`` saved with ``save_pretrained`` into ``folder`` (sharded when
    ``max_shard_size`` is given); returned in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_SCALING),
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a norm loaded into the wrong place shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def handmade_llama(folder: Path, cfg: ModelConfig | None = None, seed: int = 0, **config_changes) -> Path:
    """A Hugging Face Llama directory written without transformers: this project's random model in
    transformers' names and layout, with ``config_changes`` applied to its config.json."""
    cfg = cfg or ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_hidden_dim=96)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(hf_state_dict(model.state_dict(), cfg), folder / "model.safetensors")
    config = hf_config(cfg, "float32") | config_changes
    (folder / "config.json").write_text(json.dumps(config))
    return folder
