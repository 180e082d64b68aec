"""Hugging Face Llama weights in this model's layout and back: names, the rotary q/k layout, safetensors.

Names map one to one (``model.layers.3.self_attn.q_proj.weight`` is ``layers.3.attention.wq.weight``).
The one change of values is in wq and wk. This model rotates interleaved pairs of each head,
(x_0, x_1), (x_2, x_3), ... (Meta's reference Llama); transformers' ``LlamaForCausalLM`` rotates
the two halves, (x_0, x_{d/2}), (x_1, x_{d/2+1}), ... Both rotate pair i by m·θ_i, so the models
agree once the rows of wq and wk that make each head's outputs are reordered: HF row j·d/2 + i is
our row 2i + j (i < d/2, j ∈ {0, 1}). wv and wo are untouched: attention's output does not depend
on the order of q and k's coordinates as long as both follow the same one.

Weights are read with safetensors only, never unpickled; a tensor missing or of the wrong shape
is refused by name before anything is read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from einops import rearrange
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from diloco.config.base import ConfigError
from diloco.config.hf_llama import weight_files
from diloco.config.model import ModelConfig

# Our module path -> transformers', inside one block and at the top.
BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
    """transformers' name of our parameter ``name``: ``layers.0.attention.wq.weight`` is
    ``model.layers.0.self_attn.q_proj.weight``."""
    module, _, leaf = name.rpartition(".")
    if module in TOP_NAMES:
        return f"{TOP_NAMES[module]}.{leaf}"
    _, index, inner = module.split(".", 2)
    return f"model.layers.{index}.{BLOCK_NAMES[inner]}.{leaf}"


def rope_heads(name: str, cfg: ModelConfig) -> int | None:
    """How many heads' rows wq (n_heads) or wk (n_kv_heads) holds; None for every other weight."""
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    return None


def from_hf_rope_layout(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """wq/wk rows from halves order (HF row j·d/2 + i of each head) to interleaved (our row 2i + j)."""
    return rearrange(weight, "(h two half) n -> (h half two) n", h=heads, two=2).contiguous()


def to_hf_rope_layout(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``from_hf_rope_layout``: interleaved rows back to halves order."""
    return rearrange(weight, "(h half two) n -> (h two half) n", h=heads, two=2).contiguous()


def check_pretrained(model: nn.Module, folder: str) -> dict[str, Path]:
    """Which file holds each of ``model``'s parameters (by our name), reading only the files' headers;
    refuses a checkpoint that lacks one or holds it in another shape. Tensors the model has no
    place for (a tied checkpoint's lm_head, old rotary buffers) are ignored."""
    located = _tensor_headers(weight_files(folder))
    where: dict[str, Path] = {}
    for name, param in model.named_parameters():  # a tied output head is the embedding: listed once
        hf = hf_name(name)
        if hf not in located:
            raise ConfigError(
                f"model.init_from={folder}: the weights lack {hf} (this model's {name}); "
                "is config.json from the same checkpoint?"
            )
        path, shape = located[hf]
        if shape != list(param.shape):
            raise ConfigError(
                f"model.init_from={folder}: {hf} has shape {shape}, config.json gives {list(param.shape)}; "
                "are the weights and config.json from the same checkpoint?"
            )
        where[name] = path
    return where


def _tensor_headers(files: list[Path]) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor's file and shape, from the safetensors headers alone (no tensor is read)."""
    located = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    located[name] = (path, list(f.get_slice(name).get_shape()))
        except (OSError, SafetensorError) as error:
            raise ConfigError(
                f"model.init_from={path.parent}: cannot read {path.name} ({error}); use an intact copy"
            ) from None
    return located


@torch.no_grad()
def load_pretrained(model: nn.Module, cfg: ModelConfig) -> None:
    """Copy the checkpoint ``cfg.init_from`` into ``model``'s parameters, one tensor at a time.

    Called on the whole model right after it is built, before FSDP2 or tensor parallelism shard it:
    a worker already holds the whole model at that point (``build_replica``), so loading adds only
    the one tensor being copied (safetensors memory-maps the files), and sharding afterwards splits
    pretrained values exactly as it splits random ones. Every worker of every group reads the same
    files, so all start from the same θ, and the outer state θ_g, copied from the model after this,
    starts there too. A model too large for one worker's memory would instead be built on the meta
    device and loaded shard by shard (``set_model_state_dict``); this model is never built that way.
    """
    folder = cfg.init_from
    assert folder, "load_pretrained needs model.init_from"
    files = check_pretrained(model, folder)
    params = dict(model.named_parameters())
    for path in sorted(set(files.values())):
        with safe_open(path, framework="pt") as f:
            for name in (n for n, p in files.items() if p == path):
                value = f.get_tensor(hf_name(name))
                heads = rope_heads(name, cfg)
                if heads is not None:
                    value = from_hf_rope_layout(value, heads)
                params[name].copy_(value)  # cast to the model's dtype (bf16 checkpoints train in fp32)


def hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``state`` (this model's full state dict) under transformers' names and q/k layout.

    A tied output head is left out, as transformers saves it: ``tie_word_embeddings`` makes
    lm_head the embedding again when it loads.
    """
    out = {}
    for name, value in state.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        heads = rope_heads(name, cfg)
        value = value.detach().cpu()
        out[hf_name(name)] = to_hf_rope_layout(value, heads) if heads is not None else value.contiguous()
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file; ``format: pt`` is the metadata transformers reads to know the framework."""
    save_file(tensors, str(path), metadata={"format": "pt"})
