"""The input files of ``role=prepare`` and the documents in them, read with Hugging Face ``datasets``.

Each file is read on its own, in streaming mode (``datasets``' local builders ``text``, ``json``
and ``parquet``: nothing downloaded, nothing cached, memory bounded by a batch of documents, or by
one file for plain text read whole). One file at a time costs ~20 ms a file after the first and
buys errors that name the file, and files to share among processes in order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from diloco.config.prepare import PrepareConfig
from diloco.train.data import DataError

COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # datasets reads these through fsspec; the format is the suffix before
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}  # prepare.format -> datasets' builder
TEXT_UNITS = {"file": "document", "paragraph": "paragraph", "line": "line"}  # prepare.text_unit -> sample_by


@dataclass(frozen=True)
class Source:
    """One input file: where, how big (recorded in tokens.json), and read as which format."""

    path: Path
    bytes: int
    format: str  # text, jsonl or parquet


def find_sources(cfg: PrepareConfig) -> list[Source]:
    """``prepare.input``'s files in a fixed order (sorted relative paths; hidden files and folders
    skipped), each with its format: ``prepare.format``, or with ``auto`` its suffix (JSONL, Parquet,
    anything else text)."""
    root = Path(str(cfg.input))
    output = Path(str(cfg.output)).resolve()  # inside the input on a second run: its tokens are not text
    if not root.exists():
        raise DataError(
            f"prepare.input={cfg.input}: no such file or folder (resolved to {root.absolute()}); fix the path"
        )
    if root.is_file():
        paths = [root]
    else:
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(
                d for d in dirnames if not d.startswith(".") and (Path(dirpath) / d).resolve() != output
            )
            paths.extend(Path(dirpath) / n for n in sorted(filenames) if not n.startswith("."))
        paths.sort(key=lambda p: p.relative_to(root).as_posix())
    sources = [Source(p, p.stat().st_size, cfg.format if cfg.format != "auto" else format_of(p)) for p in paths]
    if not any(s.bytes for s in sources):
        raise DataError(
            f"prepare.input={cfg.input}: the corpus is empty (no files, or only empty ones; hidden files are "
            "skipped); point it at text, JSONL or Parquet files"
        )
    return [s for s in sources if s.bytes]


def format_of(path: Path) -> str:
    """jsonl, parquet or text, from the suffix (a compression suffix looked through)."""
    name = path.name.lower()
    for suffix in COMPRESSED:
        name = name.removesuffix(suffix)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def documents(source: Source, cfg: PrepareConfig) -> Iterator[list[str | None]]:
    """The texts of ``source``'s documents, ``cfg.batch_size`` at a time (None for a record whose
    field is null: the caller counts and skips it). A file without ``prepare.text_field``, or whose
    field holds something else than text, is refused by name."""
    import datasets  # ~1.5 s to import: only role=prepare pays it

    field = "text" if source.format == "text" else cfg.text_field
    options = {"sample_by": TEXT_UNITS[cfg.text_unit]} if source.format == "text" else {}
    try:
        if source.format == "parquet":
            _check_parquet_column(source, field)
            options["columns"] = [field]  # only the text column is read from disk
        stream = datasets.load_dataset(
            BUILDERS[source.format], data_files=[str(source.path)], split="train", streaming=True, **options
        )
        for batch in stream.iter(batch_size=cfg.batch_size):
            if field not in batch:
                raise _no_field(source, field, sorted(batch))
            texts = batch[field]
            if bad := next((t for t in texts if t is not None and not isinstance(t, str)), None):
                raise DataError(
                    f"{source.path}: field {field!r} holds {type(bad).__name__} values ({bad!r:.40}), not text; "
                    "set prepare.text_field to the field holding the text"
                )
            yield texts
    except (ValueError, KeyError, TypeError, OSError) as error:  # pyarrow's ArrowInvalid and UnicodeDecodeError too
        raise _read_error(source, error) from None


def _check_parquet_column(source: Source, field: str) -> None:
    import pyarrow.parquet as pq  # datasets' own dependency

    names = pq.read_schema(source.path).names
    if field not in names:
        raise _no_field(source, field, names)


def _no_field(source: Source, field: str, fields: list[str]) -> DataError:
    what = "column" if source.format == "parquet" else "field"
    return DataError(
        f"{source.path}: its records have no {what} {field!r} (they have: {', '.join(fields) or 'none'}); "
        f"set prepare.text_field to the {what} holding the text"
    )


def _read_error(source: Source, error: BaseException) -> DataError:
    """One line for a file ``datasets`` cannot read: the file, the format it was read as, the first
    line of the reason, and the fix."""
    if isinstance(error, DataError):
        return error
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return DataError(
        f"{source.path}: cannot read it as {source.format} ({type(error).__name__}: {reason[:300]}); "
        "fix the file, or set prepare.format to its format"
    )
