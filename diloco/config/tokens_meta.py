"""The metadata beside a prepared token file (``tokens.json``): which tokenizer made its ids, and from what.

``role=prepare`` writes ``DIR/tokens.bin`` (the ids ``data=tokens`` memory-maps), its metadata
``DIR/tokens.json`` and the tokenizer ``DIR/tokenizer/tokenizer.json``. The metadata's path is
the token file's with the suffix ``.json`` (``train.bin`` -> ``train.json``), so several token
files may share a folder and a renamed pair still finds each other; the tokenizer folder is named
in the metadata, relative to it. A token file without metadata is read as before: its width and
vocabulary come from ``data.*`` alone.

It lives in the config layer because composing a job reads it (``resolve_data_section``): the
vocabulary and the token width are the tokenizer's, and every later check (the model's vocabulary
against the data's) must see them without loading the trainer. Plain JSON, no ``tokenizers``: the
tokenizer itself is ``diloco.train.corpus_meta``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diloco.config.base import ConfigError

FORMAT = "diloco-tokens"  # what a tokens.json says it is, so another JSON file beside a .bin is not taken for one
FORMAT_VERSION = 1
TOKENIZER_FOLDER = "tokenizer"  # beside the metadata: tokenizer.json (+ a transformers directory's config files)
WIDTHS = {"uint16": 2, "uint32": 4}
NO_METADATA_VOCAB = 1 << 16  # a uint16 token file without metadata: any id is accepted, as before metadata existed


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer that made a corpus's ids: where it came from, its identity, its vocabulary."""

    source: str  # the prepare.tokenizer path, or how role=prepare trained it
    sha256: str  # of the saved tokenizer.json: two corpora with the same hash share their ids' meaning
    vocab_size: int  # ids lie in [0, vocab_size)
    eos_id: int  # written between documents
    eos_token: str
    folder: str = TOKENIZER_FOLDER  # relative to the metadata file's folder


@dataclass(frozen=True)
class SourceFile:
    path: str
    bytes: int


@dataclass(frozen=True)
class CorpusMeta:
    """What ``tokens.json`` records (``format`` and ``version`` written first, so a reader can refuse early)."""

    tokenizer: TokenizerInfo
    token_dtype: str
    documents: int
    tokens: int
    sources: tuple[SourceFile, ...]
    text_field: str | None  # the JSONL field / Parquet column read; None for plain text
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        return {"format": record.pop("format"), "version": record.pop("version"), **record}


def metadata_path(tokens_path: str | Path) -> Path:
    """``DIR/tokens.bin`` -> ``DIR/tokens.json``: the token file's metadata, whether or not it exists."""
    return Path(tokens_path).with_suffix(".json")


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest width that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_meta_file(path: Path) -> CorpusMeta:
    """The metadata at ``path``; a file that is not one (damaged, another format, another version)
    is refused by name, with the fix."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such file: role=prepare writes it beside the token file it describes; prepare the "
            "corpus first (python run.py role=prepare prepare.input=TEXT prepare.output=DIR)"
        ) from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot read it as JSON ({error}); run role=prepare again or remove it") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ConfigError(
            f'{path}: not the metadata of a prepared token file (no "format": "{FORMAT}"); '
            "rename it, or run role=prepare again to write the metadata"
        )
    if record.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{path}: metadata version {record.get('version')!r}, this code reads version {FORMAT_VERSION}; "
            "run role=prepare again with this version"
        )
    try:
        return CorpusMeta(
            tokenizer=TokenizerInfo(**record["tokenizer"]),
            token_dtype=record["token_dtype"],
            documents=int(record["documents"]),
            tokens=int(record["tokens"]),
            sources=tuple(SourceFile(**s) for s in record["sources"]),
            text_field=record.get("text_field"),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(
            f"{path}: damaged metadata ({type(error).__name__}: {error}); run role=prepare again"
        ) from None


def resolve_data_section(data: dict[str, Any]) -> dict[str, Any]:
    """``data.*`` as composed (a plain dict), with ``vocab_size`` and ``token_dtype`` filled in for a
    tokens corpus: from its metadata where there is one, else uint16 ids of a 65536 vocabulary.

    ``null`` (conf/data/tokens.yaml) means "the corpus decides"; a value given that disagrees with
    the metadata is refused, naming both, because ids read at the wrong width or checked against
    another vocabulary train a model on noise. The token file's size is checked against the
    metadata's count too, before any process starts.
    """
    data = dict(data)
    if data.get("corpus") != "tokens" or not data.get("path"):
        return data
    path = metadata_path(str(data["path"]))
    if path == Path(str(data["path"])):  # corpus/tokens.json: the metadata given for its token file
        raise ConfigError(
            f"data.path={data['path']}: must be the token file, {path.with_suffix('.bin')}, not its metadata "
            "(the .json beside the token file is read from there)"
        )
    if not path.is_file():
        data["token_dtype"] = data.get("token_dtype") or "uint16"
        if data.get("vocab_size") is None:
            data["vocab_size"] = NO_METADATA_VOCAB if data["token_dtype"] == "uint16" else None
        return data
    meta = read_meta_file(path)
    for key, recorded in (("vocab_size", meta.tokenizer.vocab_size), ("token_dtype", meta.token_dtype)):
        given = data.get(key)
        if given is not None and given != recorded:
            raise ConfigError(
                f"data.{key}={given!r}: differs from {recorded!r}, the tokenizer's, recorded in {path}; "
                f"drop data.{key} (the metadata decides) or point data.path at the corpus you meant"
            )
        data[key] = recorded
    _check_size(Path(str(data["path"])), meta, path)
    return data


def _check_size(tokens_path: Path, meta: CorpusMeta, path: Path) -> None:
    """The token file holds exactly the ids its metadata counts: else one is not the other's."""
    try:
        size = tokens_path.stat().st_size
    except OSError:
        return  # reading the corpus reports a missing file with its own fix
    expected = meta.tokens * WIDTHS[meta.token_dtype]
    if size != expected:
        raise ConfigError(
            f"{tokens_path}: {size:,} bytes, but {path} records {meta.tokens:,} {meta.token_dtype} tokens "
            f"({expected:,} bytes); the two come from different runs of role=prepare: run it again"
        )
