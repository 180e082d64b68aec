"""``prepare.*``: what ``role=prepare`` turns into a token file (``data=tokens`` reads it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.base import check

MIN_TRAINED_VOCAB = 257  # a byte-level BPE holds the 256 byte symbols plus the end-of-document token


@dataclass(frozen=True)
class PrepareConfig:
    """A corpus (``input``: a file or folder of text, JSONL or Parquet) tokenized into ``output``.

    Of a folder, the files read are those ``include`` and ``exclude`` let through (globs over the
    path relative to ``input``), hidden ones only with ``hidden``, text ones only if they look like
    text (``diloco/prepare/selection.py``).

    The tokenizer is ``tokenizer`` (a tokenizer.json or a transformers tokenizer directory), or a
    byte-level BPE of ``vocab_size`` trained on the first ``train_mb`` MB of the corpus.
    """

    input: str | None = None
    output: str | None = None
    include: tuple[str, ...] = ()  # a folder's files to read (globs like **/*.py); empty: every file
    exclude: tuple[str, ...] = ()  # a folder's files to skip (globs like docs/**), even if included
    hidden: bool = False  # read files and folders whose names start with "." (.git, .github) too
    format: Literal["auto", "text", "jsonl", "parquet"] = "auto"  # auto: from the files' suffixes
    text_field: str = "text"  # the JSONL field or Parquet column holding a document's text
    text_unit: Literal["file", "paragraph", "line"] = "file"  # what one document of a plain text file is
    tokenizer: str | None = None
    vocab_size: int | None = None
    train_mb: int = 256  # BPE training reads at most this much text: enough for merges, bounded for huge corpora
    eos_token: str | None = None  # None: the tokenizer's own (tokenizer_config.json) or a well-known name
    workers: int = 1  # processes, each tokenizing a contiguous run of the input files
    batch_size: int = 1000  # documents read per batch (encoded in chunks of ~1M characters: shards.ENCODE_CHARS)

    def validate(self) -> None:
        check(self.workers >= 1, "prepare.workers", self.workers, "must be at least 1")
        check(self.batch_size >= 1, "prepare.batch_size", self.batch_size, "must be at least 1")
        check(self.train_mb >= 1, "prepare.train_mb", self.train_mb, "must be at least 1")
        check(bool(self.text_field), "prepare.text_field", self.text_field, "must name a field or column")
        for key, patterns in (("prepare.include", self.include), ("prepare.exclude", self.exclude)):
            for pattern in patterns:
                problem = glob_problem(pattern)
                check(problem is None, key, list(patterns), problem or "")
        check(
            self.vocab_size is None or self.vocab_size >= MIN_TRAINED_VOCAB,
            "prepare.vocab_size",
            self.vocab_size,
            f"must be at least {MIN_TRAINED_VOCAB}: the 256 byte symbols plus the end-of-document token",
        )
        check(
            not (self.vocab_size and self.tokenizer),
            "prepare.vocab_size",
            self.vocab_size,
            f"trains a tokenizer, but prepare.tokenizer={self.tokenizer} gives one; drop one of the two",
        )

    def check_complete(self) -> None:
        """What ``role=prepare`` needs beyond valid values: an input, an output and a tokenizer."""
        check(bool(self.input), "prepare.input", self.input, "required: a text, JSONL or Parquet file, or a folder")
        check(bool(self.output), "prepare.output", self.output, "required: the folder to write tokens.bin into")
        check(
            bool(self.tokenizer or self.vocab_size),
            "prepare.tokenizer",
            self.tokenizer,
            "required (a tokenizer.json or a transformers tokenizer directory), or set prepare.vocab_size=N "
            "to train a byte-level BPE of N tokens on the corpus",
        )


def glob_problem(pattern: str) -> str | None:
    """Why ``pattern`` can never match a path relative to ``prepare.input`` (None: it can): a glob
    that silently matches nothing would read the whole folder, or nothing, without a word."""
    if not pattern:
        return "holds an empty pattern; remove it"
    if pattern.startswith("/"):
        return f"{pattern!r} starts with /, but patterns match paths relative to prepare.input; drop the /"
    if ".." in pattern.split("/"):
        return f"{pattern!r} has a .. part, which no path inside prepare.input has; match from prepare.input down"
    return None
