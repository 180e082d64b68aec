"""``role=export``: a trained model as a Hugging Face Llama directory that transformers loads.

``checkpoint`` names the model as for ``role=eval`` (a run directory, its model.pt, or a training
checkpoint's global model); the directory is written to ``hf/`` in this invocation's own run
directory (hydra's output folder), never into the trained run's, which stays as its job left it.
It holds config.json (``LlamaForCausalLM``), model.safetensors (transformers' names and q/k layout,
``diloco.train.hf_weights``), generation_config.json, and the tokenizer's files when the run trained
on a prepared corpus.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from diloco.config.hf_llama import hf_config, read_config
from diloco.config.job import JobConfig
from diloco.files import write_json_atomically
from diloco.launch.inference import read_weights
from diloco.train.corpus_meta import read_corpus_meta, tokenizer_folder
from diloco.train.hf_weights import hf_state_dict, save_safetensors

EXPORT_FOLDER = "hf"


def export_checkpoint(weights: Path, trained: JobConfig, out_dir: Path) -> Path:
    """Write the model in ``weights`` (trained by ``trained``) as a transformers directory in ``out_dir``."""
    state = read_weights(weights, trained)
    tensors = hf_state_dict(state, trained.model)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = read_corpus_meta(trained.data)
    ids = {"eos_token_id": meta.tokenizer.eos_id} if meta is not None else pretrained_token_ids(trained)
    save_safetensors(tensors, out_dir / "model.safetensors")
    write_json_atomically(out_dir / "config.json", hf_config(trained.model, dtype, ids))
    write_json_atomically(out_dir / "generation_config.json", dict(ids))
    folder = tokenizer_folder(trained.data)
    if folder is not None:
        for file in sorted(folder.iterdir()):
            if file.is_file():
                shutil.copyfile(file, out_dir / file.name)
    return out_dir


def pretrained_token_ids(trained: JobConfig) -> dict[str, Any]:
    """bos/eos ids of the checkpoint the run started from (``model.init_from``; composing the run's
    config read it, so it is there); none otherwise (a byte-level model has no special tokens)."""
    if not trained.model.init_from:
        return {}
    source = read_config(trained.model.init_from)
    return {key: source[key] for key in ("bos_token_id", "eos_token_id") if source.get(key) is not None}
