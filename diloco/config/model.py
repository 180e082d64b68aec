"""``model.*``: the decoder-only transformer's shape (diloco/train/model.py builds it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from diloco.config.base import check


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer; peers must agree on it exactly (see ``param_signature``)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_hidden_dim: int = 0  # 0: derive it Llama-style, see ``ffn_dim``
    ffn_dim_multiplier: float = 1.0
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Llama 3.1's long-context RoPE ("llama3"): frequencies whose wavelength exceeds
    # rope_original_max_seq_len / rope_low_freq_factor are divided by rope_factor, those shorter
    # than rope_original_max_seq_len / rope_high_freq_factor kept, those between blended smoothly.
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # A Hugging Face Llama directory: its config.json sets the shape (``job_config_from_dict``),
    # its safetensors the initial weights of every group (``diloco.train.hf_weights``).
    init_from: str | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the SwiGLU MLP.

        Llama keeps the MLP's parameter count near a 4·dim ReLU MLP despite its third
        matrix: 2/3 of 4·dim, scaled by ``ffn_dim_multiplier``, rounded up to
        ``multiple_of`` so matmuls tile well.
        """
        if self.ffn_hidden_dim > 0:
            return self.ffn_hidden_dim
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first field that cannot build a model."""
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            check(value > 0, f"model.{name}", value, "must be a positive integer")
        for name in ("ffn_dim_multiplier", "norm_eps", "rope_theta", "init_std", "rope_factor"):
            value = getattr(self, name)
            check(value > 0, f"model.{name}", value, "must be positive")
        check(
            self.ffn_hidden_dim >= 0,
            "model.ffn_hidden_dim",
            self.ffn_hidden_dim,
            "must be 0 (derive from model.dim) or a positive width",
        )
        check(
            self.dim % self.n_heads == 0,
            "model.n_heads",
            self.n_heads,
            f"must divide model.dim={self.dim}",
        )
        check(
            self.n_heads % self.n_kv_heads == 0,
            "model.n_kv_heads",
            self.n_kv_heads,
            f"must divide model.n_heads={self.n_heads} (each KV head serves a whole group of query heads)",
        )
        check(
            self.head_dim % 2 == 0,
            "model.n_heads",
            self.n_heads,
            f"gives head_dim = model.dim // model.n_heads = {self.head_dim}, which must be even "
            "for rotary embeddings; pick n_heads so that dim / n_heads is even",
        )
        if self.rope_scaling == "llama3":
            self._validate_llama3_scaling()

    def _validate_llama3_scaling(self) -> None:
        check(
            self.rope_original_max_seq_len > 0,
            "model.rope_original_max_seq_len",
            self.rope_original_max_seq_len,
            "must be a positive context length (the one the model was pre-trained at)",
        )
        check(
            0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
            "model.rope_high_freq_factor",
            self.rope_high_freq_factor,
            f"must exceed model.rope_low_freq_factor={self.rope_low_freq_factor} > 0 (llama3 RoPE scaling "
            "blends the frequencies between the two)",
        )
