"""The tokenizer ``role=prepare`` writes ids with: one given (a ``tokenizer.json``, or a
transformers tokenizer directory holding one), or a byte-level BPE trained on the corpus.

Either way it is saved in ``OUTPUT/tokenizer/`` beside the ids: a given tokenizer.json is copied
byte for byte, so its sha256 in tokens.json is the source's own and two corpora prepared with
the same tokenizer show it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.config.tokens_meta import TOKENIZER_FOLDER, TokenizerInfo
from diloco.files import file_sha256
from diloco.train.data import DataError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TRANSFORMERS_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # copied along when present
TRAINED_EOS = "<|endoftext|>"
# Tried in order when neither prepare.eos_token nor the directory's config names one: GPT-2's and
# Llama 3's document separators, SentencePiece's end of sequence, Gemma's.
KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


@dataclass
class ChosenTokenizer:
    """A tokenizer ready to be saved: the object, its end-of-document token, where it came from."""

    tokenizer: Tokenizer
    eos_token: str
    source: str
    file: Path | None  # a given tokenizer.json, copied as is; None: trained, saved with Tokenizer.save
    extra_files: tuple[Path, ...] = ()


def given_tokenizer(path_text: str, eos_token: str | None) -> ChosenTokenizer:
    """``prepare.tokenizer``: a tokenizer.json, or a transformers tokenizer directory."""
    from tokenizers import Tokenizer

    path = Path(path_text)
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise DataError(
                f"prepare.tokenizer={path_text}: the folder holds no {TOKENIZER_FILE} (a slow, SentencePiece-only "
                "tokenizer?); save it with transformers' AutoTokenizer.from_pretrained(..., use_fast=True)"
                ".save_pretrained(DIR), or point at a tokenizer.json"
            )
        extra = tuple(path / name for name in TRANSFORMERS_FILES if (path / name).is_file())
    elif path.is_file():
        file, extra = path, ()
    else:
        raise DataError(f"prepare.tokenizer={path_text}: no such file or folder; point it at a tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise DataError(f"prepare.tokenizer={path_text}: {file} is not a tokenizers tokenizer.json ({first})") from None
    eos = (
        eos_token
        or _configured_eos(extra)
        or next((t for t in KNOWN_EOS if tokenizer.token_to_id(t) is not None), None)
    )
    if eos is None or tokenizer.token_to_id(eos) is None:
        raise DataError(
            f"prepare.tokenizer={path_text}: "
            + (f"has no token {eos!r}" if eos else f"names no end-of-document token (none of {', '.join(KNOWN_EOS)})")
            + "; set prepare.eos_token to the token written between documents"
        )
    return ChosenTokenizer(tokenizer, eos, str(path.absolute()), file, extra)


def _configured_eos(files: Iterable[Path]) -> str | None:
    """The ``eos_token`` a transformers directory's tokenizer_config.json (or special_tokens_map.json) names."""
    for file in files:
        try:
            value = json.loads(file.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):  # AddedToken serialised: {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


def train_bpe(texts: Iterator[str], vocab_size: int, train_mb: int) -> ChosenTokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte a symbol, so any text encodes and decodes back)
    of at most ``vocab_size`` tokens, trained on the first ``train_mb`` MB of ``texts``; the
    end-of-document token is id 0. A small corpus may yield fewer merges than asked: the vocabulary
    recorded is the one trained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_first_bytes(texts, train_mb << 20), trainer=trainer)
    return ChosenTokenizer(
        tokenizer, TRAINED_EOS, f"trained: byte-level BPE, vocab_size={vocab_size}, first {train_mb} MB", None
    )


def short_vocabulary_line(asked: int, trained: int, corpus_bytes: int, train_mb: int) -> str | None:
    """The line ``role=prepare`` says when the trained BPE holds fewer tokens than ``prepare.vocab_size``
    asked (every pair in the text read was merged before the count was reached), else None: the
    model's vocabulary follows the smaller one, which no other line would show."""
    if trained >= asked:
        return None
    if corpus_bytes > train_mb << 20:
        why = f"the first {train_mb} MB read for training (prepare.train_mb) have no more pairs to merge"
    else:
        why = f"the corpus ({corpus_bytes:,} bytes) is too small to have that many merges"
    return (
        f"prepare: the trained vocabulary holds {trained:,} tokens, not the {asked:,} asked: {why}; "
        f"tokens.json records {trained:,} and the model follows it"
    )


def _first_bytes(texts: Iterator[str], budget: int) -> Iterator[str]:
    for text in texts:
        if budget <= 0:
            return
        budget -= len(text)  # characters: close enough to bytes for a training budget
        yield text


def vocab_size_of(tokenizer: Tokenizer) -> int:
    """Ids lie in [0, this): one past the largest id, added tokens included (ids may have gaps)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def save_tokenizer(chosen: ChosenTokenizer, output: Path) -> TokenizerInfo:
    """Write ``OUTPUT/tokenizer/`` and describe it for tokens.json."""
    folder = output / TOKENIZER_FOLDER
    if folder.exists():
        shutil.rmtree(folder)  # a previous run's files (say, a transformers config) must not outlive it
    folder.mkdir(parents=True)
    target = folder / TOKENIZER_FILE
    if chosen.file is not None:
        shutil.copyfile(chosen.file, target)
    else:
        chosen.tokenizer.save(str(target))
    for extra in chosen.extra_files:
        shutil.copyfile(extra, folder / extra.name)
    return TokenizerInfo(
        source=chosen.source,
        sha256=file_sha256(target),
        vocab_size=vocab_size_of(chosen.tokenizer),
        eos_id=chosen.tokenizer.token_to_id(chosen.eos_token),
        eos_token=chosen.eos_token,
    )
