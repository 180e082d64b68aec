"""A prepared corpus's metadata and tokenizer, found from its ``DataConfig``.

The metadata format (``tokens.json`` beside ``tokens.bin``) is ``diloco.config.tokens_meta``'s;
this module finds it for a job's data and loads the tokenizer it names, so ``role=sample`` and
``role=eval`` speak text through the tokenizer that made the ids, and ``role=export`` can copy
its files. Only ``load_tokenizer`` imports ``tokenizers``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from diloco.config.data import DataConfig
from diloco.config.tokens_meta import CorpusMeta, metadata_path, read_meta_file
from diloco.files import file_sha256
from diloco.train.data import DataError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def read_corpus_meta(data_cfg: DataConfig) -> CorpusMeta | None:
    """The metadata of ``data_cfg``'s token file, or None: another corpus, or a token file without it."""
    if data_cfg.corpus != "tokens" or not data_cfg.path:
        return None
    path = metadata_path(data_cfg.path)
    return read_meta_file(path) if path.is_file() else None


def tokenizer_folder(data_cfg: DataConfig) -> Path | None:
    """The folder of the corpus's tokenizer files (tokenizer.json, and a transformers directory's
    tokenizer_config.json / special_tokens_map.json when it came from one), or None when the corpus
    has no metadata (stdlib and text corpora are byte-tokenized: they have no files)."""
    meta = read_corpus_meta(data_cfg)
    return None if meta is None else _folder_of(data_cfg, meta)


def _folder_of(data_cfg: DataConfig, meta: CorpusMeta) -> Path:
    """The tokenizer folder ``meta`` names, relative to itself; refused when its tokenizer.json is gone."""
    folder = metadata_path(str(data_cfg.path)).parent / meta.tokenizer.folder
    if not (folder / "tokenizer.json").is_file():
        raise DataError(
            f"{folder}: no tokenizer.json, which {metadata_path(str(data_cfg.path))} names as its tokenizer; "
            "copy the prepared folder whole, or run role=prepare again"
        )
    return folder


class CorpusTokenizer:
    """A prepared corpus's tokenizer with the byte tokenizer's interface (``encode`` to a 1-D
    int64 tensor, ``decode`` from ids), so sampling and evaluation need not know which one they have."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the metadata's: ids the tokenizer can decode lie below it

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.tokenizer.decode(values, skip_special_tokens=False)


def load_tokenizer(data_cfg: DataConfig) -> CorpusTokenizer | None:
    """The tokenizer of ``data_cfg``'s prepared corpus, or None (no metadata: no tokenizer here).

    Refused when its tokenizer.json is not the one the metadata records (by sha256): ids decoded
    with another tokenizer read as plausible nonsense.
    """
    meta = read_corpus_meta(data_cfg)
    if meta is None:
        return None
    folder = _folder_of(data_cfg, meta)
    from tokenizers import Tokenizer  # only where text is encoded or decoded

    file = folder / "tokenizer.json"
    if (digest := file_sha256(file)) != meta.tokenizer.sha256:
        raise DataError(
            f"{file}: sha256 {digest[:12]}... differs from {meta.tokenizer.sha256[:12]}... recorded in "
            f"{metadata_path(str(data_cfg.path))}; the tokenizer was replaced after role=prepare: restore it "
            "or prepare the corpus again"
        )
    return CorpusTokenizer(Tokenizer.from_file(str(file)), meta.tokenizer.vocab_size)
