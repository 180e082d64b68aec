"""A decoder-only Llama-3-style transformer: the inner model θ that each DiLoCo worker trains.

Pre-norm residual blocks of grouped-query attention with rotary positions and a SwiGLU MLP,
RMSNorm everywhere and no biases (Llama 3, Dubey et al. 2024). ``ModelConfig`` is the only
door into the model. The layout is chosen for the trainer: each ``TransformerBlock`` is a
self-contained module that FSDP2 can ``fully_shard`` on its own, and the rotary tables live
once on the ``Transformer`` and are passed down in ``forward``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.overrides import TorchFunctionMode

from diloco.config.model import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) · g, computed in fp32 so bf16 activations do not lose the mean square."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | None = None,
    scaling: ModelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles m·θ_i, each [max_seq_len, head_dim // 2], in fp32.

    θ_i = theta^(-2i / head_dim) (Su et al. 2021); Llama 3 raises the base to 500000 so
    the slowest pairs barely turn over long contexts. ``scaling``: a config whose
    ``rope_scaling`` is "llama3" stretches the slow frequencies (``llama3_frequencies``).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is not None and scaling.rope_scaling == "llama3":
        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def llama3_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's RoPE scaling for contexts beyond the pre-training length L = rope_original_max_seq_len.

    A pair whose wavelength 2π/θ_i is longer than L / low_freq_factor never completed a turn
    in pre-training: its frequency is divided by ``rope_factor`` (position interpolation). One
    shorter than L / high_freq_factor turned many times and is kept. In between, the two are
    blended linearly in L / wavelength, so the spectrum has no step.
    """
    low, high, factor = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
    turns = cfg.rope_original_max_seq_len / (2 * math.pi / inv_freq)  # L / wavelength
    keep = ((turns - low) / (high - low)).clamp(0.0, 1.0)  # 0: interpolate fully, 1: keep as is
    return (1 - keep) * inv_freq / factor + keep * inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, seq, heads, head_dim] by position; cos/sin are [seq, head_dim // 2].

    Pairs are interleaved — (x_0, x_1), (x_2, x_3), … — as in Meta's reference Llama, where
    each pair is one complex number multiplied by e^{i m θ_i}. Because it is a rotation,
    q_m · k_n depends only on m - n.
    """
    pairs = rearrange(x.float(), "b s h (d two) -> b s h d two", two=2)
    x1, x2 = pairs.unbind(-1)
    cos = rearrange(cos.float(), "s d -> s 1 d")
    sin = rearrange(sin.float(), "s d -> s 1 d")
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rearrange(rotated, "b s h d two -> b s h (d two)").type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = rearrange(self.wq(x), "b s (h d) -> b s h d", d=self.head_dim)
        k = rearrange(self.wk(x), "b s (h d) -> b s h d", d=self.head_dim)
        v = rearrange(self.wv(x), "b s (h d) -> b h s d", d=self.head_dim)
        q = rearrange(apply_rotary(q, cos, sin), "b s h d -> b h s d")
        k = rearrange(apply_rotary(k, cos, sin), "b s h d -> b h s d")
        # enable_gqa lets SDPA broadcast each KV head over its query group without copying.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) ⊙ w3 x) (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


BlockBody = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TransformerBlock(nn.Module):
    """h = x + Attn(norm(x)); out = h + FFN(norm(h)). The unit FSDP2 shards."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self._wrapped_body: BlockBody | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return (self._wrapped_body or self.body)(x, cos, sin)

    def body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def wrap_body(self, wrapper: Callable[[BlockBody], BlockBody]) -> None:
        """Run the block's computation through ``wrapper`` (activation checkpointing, torch.compile:
        ``diloco.train.block_wrappers``). A function and not a wrapper module, so the parameter names
        the outer sync, digests and checkpoints match by stay the plain block's, and module hooks
        (FSDP2's all-gathers) stay outside the wrapped computation."""
        self._wrapped_body = wrapper(self._wrapped_body or self.body)


class Transformer(nn.Module):
    """Token ids [batch, seq] → next-token logits [batch, seq, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        cfg.validate()
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # Keyed by the block's index, so a pipeline stage that keeps some blocks keeps their names.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from cfg, so checkpoints and the outer sync never carry them.
        # Kept fp32; cast parameters with a mixed-precision policy, not model.to(bf16), so the
        # angles m·θ_i stay exact at long positions. init_weights fills them.
        table_shape = (cfg.max_seq_len, cfg.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(table_shape, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape, dtype=torch.float32), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise parameters and rotary tables in place.

        Also the second half of meta-device construction: after ``to_empty`` the storage
        is garbage, buffers included. Residual output projections (wo, w2) get
        std / sqrt(2·n_layers) so the residual stream's variance stays O(1) with depth
        (GPT-2, Radford et al. 2019).
        """
        if self.rope_cos.is_meta:
            return  # no storage to fill (meta_model): to_empty, then init_weights
        cfg = self.cfg
        cos, sin = rotary_tables(
            cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=self.rope_cos.device, scaling=cfg
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for block in self.layers.values():
            nn.init.normal_(block.attention.wo.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.feed_forward.w2.weight, mean=0.0, std=residual_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] in, logits out; a pipeline stage (``diloco.train.pipeline``) without
        the embedding takes the previous stage's hidden states [batch, seq, dim] instead, and one
        without the head returns its hidden states."""
        if self.tok_embeddings is not None and tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        seq = tokens.shape[1]  # the whole sequence (sequence parallelism splits the embedding's output)
        if seq > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                "raise model.max_seq_len or shorten the data's sequences"
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.output is None:
            return h
        return self.output(self.norm(h))


def meta_model(cfg: ModelConfig) -> Transformer:
    """The model without storage or values: its parameters' names, shapes and dtypes, to count and sign.

    Nothing is initialised: on the meta device ``normal_`` runs a Python reference kernel
    whose first call imports torch._dynamo, a second of CPU that the launcher, an eval or a
    benchmark would pay before it starts anything.
    """
    with torch.device("meta"), _SkipNormalInit():
        return Transformer(cfg)


class _SkipNormalInit(TorchFunctionMode):
    """``nn.init.normal_`` returns its tensor untouched (nn.Embedding calls it as it is built)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.init.normal_:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable values; a tied embedding/output weight counts once.

    ``parameters()`` already skips repeats of the same tensor; under FSDP2 ``numel`` of a
    DTensor is the global size, so every rank reports the full model.
    """
    return sum(p.numel() for p in model.parameters())


# Wrappers that rename parameters without changing the model (torch.compile, activation
# checkpointing); peers that wrap differently must still agree.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def param_signature(cfg: ModelConfig, model: nn.Module) -> str:
    """``signature`` of this project's model under its config."""
    return signature(model, dataclasses.asdict(cfg))


def signature(model: nn.Module, config: dict[str, Any]) -> str:
    """Short sha256 over ``config`` and every parameter's (name, shape, dtype).

    The outer step averages Δθ element by element across peers, so a peer whose model
    differs in any of these would corrupt the average silently; comparing signatures at
    join time refuses it instead.
    """
    params = []
    for name, p in model.named_parameters():
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        params.append([name, list(p.shape), str(p.dtype)])
    payload = json.dumps({"config": config, "params": params}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
