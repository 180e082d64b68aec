"""A Hugging Face Llama directory's config.json, read as ``model.*`` keys and written from them.

``model.init_from`` names such a directory; the model's shape, vocabulary and RoPE come from its
config.json when the job is composed (``job_config_from_dict``), so every later check (vocabulary
against the data, sequence length, tensor parallelism) sees the real shape. It lives in the config
layer for that reason: composing a job must not load the trainer. The weights themselves are
``diloco.train.hf_weights``'s.

Both config.json dialects are read: transformers 4.x's ``rope_theta`` + ``rope_scaling`` and 5.x's
``rope_parameters``. The 4.x one is written, which both versions load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diloco.config.base import ConfigError
from diloco.config.model import ModelConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# model.* key -> the config.json key it comes from (the RoPE keys are read by ``_rope_keys``).
SHAPE_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
}
# Absent from some configs: older ones have no grouped-query attention; LlamaConfig unties by default.
_OPTIONAL = {"num_key_value_heads": None, "tie_word_embeddings": False}
LLAMA3_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_seq_len": "original_max_position_embeddings",
}
_DEFAULTS = ModelConfig()


def with_pretrained_shape(model: dict[str, Any]) -> dict[str, Any]:
    """``model`` (the composed ``model.*`` keys) with every key config.json decides set from it.

    A value that differs from both config.json's and the dataclass default was asked for on the
    command line or by a ``model=`` preset: refused, naming both, rather than silently replaced
    or silently kept. (The composed dict does not say which of the two set it.)
    """
    folder = model["init_from"]
    pretrained = pretrained_model_keys(folder)
    for key, value in pretrained.items():
        asked = model.get(key, value)
        if asked != value and (key == "vocab_size" or asked != getattr(_DEFAULTS, key)):
            raise ConfigError(
                f"model.{key}={asked!r} conflicts with {Path(folder) / CONFIG_FILE}, which gives {value!r}; "
                f"with model.init_from the shape comes from config.json: drop model.{key} (and any model= preset)"
            )
    return model | pretrained


def pretrained_model_keys(folder: str) -> dict[str, Any]:
    """The ``model.*`` values the Llama checkpoint in ``folder`` fixes; refuses what this model cannot be."""
    config = read_config(folder)
    where = f"model.init_from={folder}"
    model_type = config.get("model_type")
    if model_type != "llama":
        raise ConfigError(
            f"{where}: config.json's model_type is {model_type!r}, not 'llama'; only Llama checkpoints "
            "(LlamaForCausalLM) can start a job"
        )
    missing = [hf for hf in SHAPE_KEYS.values() if hf not in config and hf not in _OPTIONAL]
    if missing:
        raise ConfigError(f"{where}: config.json lacks {missing[0]}; is it a complete Llama config?")
    keys = {ours: config.get(hf, _OPTIONAL.get(hf)) for ours, hf in SHAPE_KEYS.items()}
    if keys["n_kv_heads"] is None:  # older configs: no grouped-query attention
        keys["n_kv_heads"] = keys["n_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * keys["n_heads"] != keys["dim"]:
        raise ConfigError(
            f"{where}: config.json's head_dim={head_dim} is not hidden_size/num_attention_heads="
            f"{keys['dim']}/{keys['n_heads']}; this model derives head_dim from dim, so it cannot hold these weights"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ConfigError(
                f"{where}: config.json sets {flag}=true; this model has no biases, so it cannot load them"
            )
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{where}: config.json's hidden_act is {config['hidden_act']!r}; this model's MLP is SwiGLU (silu)"
        )
    return keys | _rope_keys(config, where)


def _rope_keys(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``rope_theta`` and the llama3 scaling keys from either dialect (5.x ``rope_parameters``, 4.x
    ``rope_theta`` + ``rope_scaling``)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))  # transformers' own default base
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if kind != "llama3":
        raise ConfigError(
            f"{where}: config.json's RoPE scaling type {kind!r} is not supported; only none and 'llama3' "
            "(Llama 3.1/3.2) are"
        )
    missing = [hf for hf in LLAMA3_KEYS.values() if hf not in rope]
    if missing:
        raise ConfigError(f"{where}: config.json's llama3 RoPE scaling lacks {missing[0]}")
    keys = {ours: rope[hf] for ours, hf in LLAMA3_KEYS.items()}
    for ours in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        keys[ours] = float(keys[ours])
    return {"rope_theta": float(theta), "rope_scaling": "llama3"} | keys


def read_config(folder: str | Path) -> dict[str, Any]:
    """config.json of the Hugging Face directory ``folder``, which must also hold safetensors weights."""
    path = Path(folder) / CONFIG_FILE
    where = f"model.init_from={folder}"
    if not path.is_file():
        what = "has no config.json" if Path(folder).is_dir() else "is not a directory"
        raise ConfigError(
            f"{where}: {what}; point it at a Hugging Face Llama directory (config.json + model*.safetensors)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: cannot read config.json ({error}); use an intact copy") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config.json holds no JSON object; use an intact copy")
    weight_files(folder)  # refused now, not once every worker has started
    return config


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of ``folder``: model.safetensors, or the shards its index names."""
    folder = Path(folder)
    where = f"model.init_from={folder}"
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    if not (folder / INDEX_FILE).is_file():
        raise ConfigError(
            f"{where}: holds neither {SINGLE_FILE} nor {INDEX_FILE}; save the model with safetensors "
            "(save_pretrained's default) into this directory"
        )
    shards = sorted(set(weight_map(folder).values()))
    absent = [name for name in shards if not (folder / name).is_file()]
    if absent:
        raise ConfigError(f"{where}: {INDEX_FILE} names {absent[0]}, which is not there; copy every shard")
    return [folder / name for name in shards]


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from a sharded checkpoint's index."""
    try:
        index = json.loads((folder / INDEX_FILE).read_text())
        mapping = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"model.init_from={folder}: cannot read {INDEX_FILE} ({error!r}); use an intact copy"
        ) from None
    return dict(mapping)


def hf_config(cfg: ModelConfig, dtype: str, token_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """config.json of a ``LlamaForCausalLM`` with ``cfg``'s shape; ``token_ids``: bos/eos ids when known."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,  # derived widths are written as the width they gave
        "initializer_range": cfg.init_std,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    config |= {hf: getattr(cfg, ours) for ours, hf in SHAPE_KEYS.items() if ours != "ffn_hidden_dim"}
    if cfg.rope_scaling == "llama3":
        config["rope_scaling"] = {"rope_type": "llama3"} | {hf: getattr(cfg, ours) for ours, hf in LLAMA3_KEYS.items()}
    return config | dict(token_ids or {})
