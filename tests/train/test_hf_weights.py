"""Hugging Face Llama weights in this model's layout: the q/k permutation, names, refusals, round trip."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco.config.base import ConfigError
from diloco.config.job import job_config_from_dict
from diloco.config.model import ModelConfig
from diloco.train.hf_weights import (
    check_pretrained,
    from_hf_rope_layout,
    hf_name,
    to_hf_rope_layout,
)
from diloco.train.model import Transformer, apply_rotary, llama3_frequencies, rotary_tables
from tests.hf_checkpoints import handmade_llama


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' Llama applies it: pair i is (x_i, x_{i+d/2}). Written from the formula."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def test_permuted_rows_make_rotate_half_rope_give_our_attention_scores():
    torch.manual_seed(0)
    heads, head_dim, seq = 3, 8, 5
    wq, wk = torch.randn(heads * head_dim, 16), torch.randn(heads * head_dim, 16)
    x = torch.randn(1, seq, 16)
    cos, sin = rotary_tables(head_dim, seq, 10000.0)

    def scores(q, k):
        return torch.einsum("bshd,bthd->bhst", q, k)

    def project(w):
        return (x @ w.T).view(1, seq, heads, head_dim)

    ours = scores(apply_rotary(project(wq), cos, sin), apply_rotary(project(wk), cos, sin))
    hf_q, hf_k = to_hf_rope_layout(wq, heads), to_hf_rope_layout(wk, heads)
    theirs = scores(rotate_half_rope(project(hf_q), cos, sin), rotate_half_rope(project(hf_k), cos, sin))
    assert torch.allclose(theirs, ours, rtol=1e-5, atol=1e-5), (theirs - ours).abs().max()
    unpermuted = scores(rotate_half_rope(project(wq), cos, sin), rotate_half_rope(project(wk), cos, sin))
    assert not torch.allclose(unpermuted, ours, atol=1e-3)  # the permutation is needed, not a no-op
    assert torch.equal(from_hf_rope_layout(hf_q, heads), wq)


def test_llama3_scaling_keeps_fast_pairs_interpolates_slow_ones_and_blends_between():
    cfg = ModelConfig(rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=64)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    scaled = llama3_frequencies(inv_freq, cfg)
    wavelength = 2 * torch.pi / inv_freq
    assert torch.equal(scaled[wavelength < 64 / 4], inv_freq[wavelength < 64 / 4])
    assert torch.allclose(scaled[wavelength > 64], inv_freq[wavelength > 64] / 8)
    between = (wavelength >= 16) & (wavelength <= 64)
    assert between.any() and ((scaled[between] < inv_freq[between]) & (scaled[between] > inv_freq[between] / 8)).all()


def test_names_map_to_transformers_names():
    assert hf_name("layers.1.attention.wq.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert hf_name("layers.0.feed_forward.w1.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert (hf_name("tok_embeddings.weight"), hf_name("output.weight")) == (
        "model.embed_tokens.weight",
        "lm_head.weight",
    )


def test_a_tensor_missing_or_misshapen_is_refused_by_name(tmp_path):
    source = handmade_llama(tmp_path / "hf")
    model = Transformer(job_config_from_dict({"model": {"init_from": str(source)}}).model)
    with safe_open(source / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    norm = "model.layers.1.input_layernorm.weight"
    save_file({k: v for k, v in tensors.items() if k != norm}, source / "model.safetensors")
    with pytest.raises(ConfigError, match=f"the weights lack {norm} \\(this model's layers.1.attention_norm.weight\\)"):
        check_pretrained(model, str(source))
    save_file(tensors | {norm: torch.ones(32)}, source / "model.safetensors")
    with pytest.raises(ConfigError, match=f"{norm} has shape \\[32\\], config.json gives \\[64\\]"):
        check_pretrained(model, str(source))
    (source / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="cannot read model.safetensors"):
        check_pretrained(model, str(source))
