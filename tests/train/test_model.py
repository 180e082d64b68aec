"""The transformer's contracts: shapes, causality, RoPE, GQA, tying, config errors, presets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from einops import rearrange, repeat
from omegaconf import OmegaConf

from diloco.config.base import ConfigError, from_dict
from diloco.config.model import ModelConfig
from diloco.train.model import (
    Attention,
    Transformer,
    apply_rotary,
    count_parameters,
    meta_model,
    param_signature,
    rotary_tables,
)
from tests.conftest import CONF_DIR

PRESETS = CONF_DIR / "model"
TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)


def load_preset(name: str) -> ModelConfig:
    return from_dict(ModelConfig, OmegaConf.to_container(OmegaConf.load(PRESETS / f"{name}.yaml")), "model")


def build(cfg: ModelConfig = TINY, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


def test_forward_shape_and_too_long_sequence() -> None:
    model = build()
    tokens = torch.randint(TINY.vocab_size, (3, 17))
    assert model(tokens).shape == (3, 17, TINY.vocab_size)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_causal_mask() -> None:
    model = build(dataclasses.replace(TINY, init_std=0.2)).double()
    tokens = torch.randint(TINY.vocab_size, (2, 12))
    base = model(tokens)
    for t in (0, 5, 11):
        perturbed = tokens.clone()
        perturbed[:, t] = (perturbed[:, t] + 1) % TINY.vocab_size
        out = model(perturbed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-12)
        changed = (out[:, t:] - base[:, t:]).abs().amax(dim=-1)
        assert (changed > 1e-9).all(), f"positions >= {t} ignored token {t}: {changed}"


def test_rotary_preserves_norm_and_position_zero_is_identity() -> None:
    cos, sin = rotary_tables(head_dim=16, max_seq_len=64, theta=10000.0)
    x = torch.randn(2, 64, 3, 16)
    rotated = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rotated[:, 0], x[:, 0], rtol=0, atol=0)


def test_rotary_dot_product_depends_only_on_offset() -> None:
    seq, head_dim = 64, 16
    cos, sin = rotary_tables(head_dim, seq, theta=10000.0)
    q, k = torch.randn(2, head_dim, dtype=torch.float64)
    # The same q and k placed at every position, then rotated by position.
    q_rot = apply_rotary(q.expand(1, seq, 1, head_dim), cos, sin)[0, :, 0]
    k_rot = apply_rotary(k.expand(1, seq, 1, head_dim), cos, sin)[0, :, 0]
    for offset in (0, 1, 7, 30):
        dots = [q_rot[n + offset] @ k_rot[n] for n in (0, 3, 20, seq - 1 - offset)]
        # The angle tables are fp32, so agreement is to fp32 precision.
        torch.testing.assert_close(torch.stack(dots), dots[0].expand(4), rtol=1e-5, atol=1e-6)
    assert not torch.isclose(q_rot[1] @ k_rot[0], q_rot[2] @ k_rot[0])


def test_gqa_matches_explicit_repeated_kv_attention() -> None:
    cfg = dataclasses.replace(TINY, n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    attn = Attention(cfg).double()
    x = torch.randn(2, 10, cfg.dim, dtype=torch.float64)
    cos, sin = rotary_tables(cfg.head_dim, 10, cfg.rope_theta)

    group = cfg.n_heads // cfg.n_kv_heads
    q = apply_rotary(rearrange(attn.wq(x), "b s (h d) -> b s h d", h=cfg.n_heads), cos, sin)
    k = apply_rotary(rearrange(attn.wk(x), "b s (h d) -> b s h d", h=cfg.n_kv_heads), cos, sin)
    v = rearrange(attn.wv(x), "b s (h d) -> b s h d", h=cfg.n_kv_heads)
    # Query head i uses KV head i // group.
    k = repeat(k, "b s h d -> b s (h g) d", g=group)
    v = repeat(v, "b s h d -> b s (h g) d", g=group)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
    future = torch.ones(10, 10, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    expected = attn.wo(rearrange(torch.einsum("bhqk,bkhd->bqhd", weights, v), "b s h d -> b s (h d)"))

    torch.testing.assert_close(attn(x, cos, sin), expected)


def test_tied_embeddings_share_one_parameter() -> None:
    untied, tied = build(TINY), build(dataclasses.replace(TINY, tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    embedding = TINY.vocab_size * TINY.dim
    assert count_parameters(tied) == count_parameters(untied) - embedding
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1


def test_init_weights_scales_residual_projections_and_resets_norms() -> None:
    cfg = dataclasses.replace(TINY, dim=256, n_layers=8, n_heads=4, n_kv_heads=4)
    model = build(cfg)
    block = model.layers["0"]
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    assert block.attention.wq.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(cfg.dim))


def test_meta_materialisation_then_init_weights_matches_eager() -> None:
    eager = build(TINY)
    with torch.device("meta"):
        lazy = Transformer(TINY)
    lazy.to_empty(device="cpu")  # garbage storage, rotary buffers included
    for model in (eager, lazy):
        torch.manual_seed(1)
        model.init_weights()
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    torch.testing.assert_close(lazy.rope_cos, eager.rope_cos)
    torch.testing.assert_close(lazy.rope_sin, eager.rope_sin)
    tokens = torch.randint(TINY.vocab_size, (2, 8))
    torch.testing.assert_close(lazy(tokens), eager(tokens))


def test_rotary_buffers_stay_out_of_blocks_and_state_dict() -> None:
    model = build()
    assert "rope_cos" not in model.state_dict()
    assert all(not list(block.buffers()) for block in model.layers.values())


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"n_heads": 5}, "model.n_heads=5: must divide model.dim=32"),
        ({"n_kv_heads": 3}, "model.n_kv_heads"),
        ({"dim": 24, "n_heads": 8}, "model.n_heads.*even"),
        ({"n_layers": 0}, "model.n_layers"),
        ({"vocab_size": -1}, "model.vocab_size"),
        ({"norm_eps": 0.0}, "model.norm_eps"),
        ({"ffn_hidden_dim": -4}, "model.ffn_hidden_dim"),
    ],
)
def test_validate_names_the_key(change: dict, key: str) -> None:
    cfg = dataclasses.replace(TINY, **change)
    with pytest.raises(ConfigError, match=key):
        cfg.validate()
    with pytest.raises(ConfigError, match=key):
        Transformer(cfg)


def test_ffn_dim_llama_rule() -> None:
    # 2/3 · 4 · 512 = 1365 → rounded up to a multiple of 32.
    assert ModelConfig(dim=512).ffn_dim == 1376
    assert ModelConfig(dim=512, ffn_dim_multiplier=1.5, multiple_of=256).ffn_dim == 2048
    assert ModelConfig(dim=512, ffn_hidden_dim=1000).ffn_dim == 1000


def test_the_meta_model_has_the_built_models_parameters_without_storage() -> None:
    for cfg in (TINY, dataclasses.replace(TINY, tie_embeddings=True)):
        shapes, eager = meta_model(cfg), build(cfg)
        assert all(p.is_meta for p in shapes.parameters()) and shapes.rope_cos.is_meta
        assert [(n, p.shape, p.dtype) for n, p in shapes.named_parameters()] == [
            (n, p.shape, p.dtype) for n, p in eager.named_parameters()
        ]
        assert count_parameters(shapes) == count_parameters(eager)
        assert param_signature(cfg, shapes) == param_signature(cfg, eager)


def test_param_signature_stable_and_shape_sensitive() -> None:
    a, b = build(TINY, seed=0), build(TINY, seed=1)
    assert param_signature(TINY, a) == param_signature(TINY, b)
    wider = dataclasses.replace(TINY, ffn_hidden_dim=96)
    assert param_signature(wider, build(wider)) != param_signature(TINY, a)
    assert param_signature(TINY, a.to(torch.float64)) != param_signature(TINY, b)


@pytest.mark.parametrize("name", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_preset_loads_and_validates(name: str) -> None:
    data = OmegaConf.to_container(OmegaConf.load(PRESETS / f"{name}.yaml"))  # deltas over ModelConfig()
    assert "vocab_size" not in data, "the data decides vocab_size"
    load_preset(name).validate()


def test_tiny_preset_trains_one_step() -> None:
    cfg = load_preset("tiny")
    model = build(cfg)
    tokens = torch.randint(cfg.vocab_size, (2, 16))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_small_preset_parameter_count() -> None:
    model = meta_model(load_preset("small"))
    assert 15e6 <= count_parameters(model) <= 25e6


def test_llama3_1b_preset_structure() -> None:
    cfg = load_preset("llama3_1b")
    model = meta_model(cfg)
    assert len(model.layers) == 16
    attn = model.layers["0"].attention
    assert (attn.n_heads, attn.n_kv_heads) == (32, 8)
    assert attn.wk.weight.shape == (8 * 64, 2048)
    assert model.layers["0"].feed_forward.w1.weight.shape == (8192, 2048)
    assert model.output.weight is model.tok_embeddings.weight
    assert 0.9e9 <= count_parameters(model) <= 1.0e9
