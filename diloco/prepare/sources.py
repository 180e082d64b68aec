"""The input files of ``role=prepare`` and the documents in them, read with Hugging Face ``datasets``.

Each file is read on its own, in streaming mode (``datasets``' local builders ``text``, ``json``
and ``parquet``: nothing downloaded, nothing cached, memory bounded by a batch of documents, or by
one file for plain text read whole). One file at a time costs ~20 ms a file after the first and
buys errors that name the file, and files to share among processes in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from diloco.config.prepare import PrepareConfig
from diloco.prepare.selection import COMPRESSED, Skipped, listed_files, not_text
from diloco.train.data import DataError

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


@dataclass(frozen=True)
class Found:
    """``prepare.input``'s files to read, and those of its folder that were skipped."""

    sources: list[Source]
    skipped: Skipped


def find_sources(cfg: PrepareConfig) -> Found:
    """``prepare.input``'s files in a fixed order (sorted relative paths), each with its format:
    ``prepare.format``, or with ``auto`` its suffix (JSONL, Parquet, anything else text). Of a
    folder, the files ``selection`` lets through and that are not empty; a text file must look
    like text (``selection.not_text``)."""
    root = Path(str(cfg.input))
    if not root.exists():
        raise DataError(
            f"prepare.input={cfg.input}: no such file or folder (resolved to {root.absolute()}); fix the path"
        )
    if root.is_file():
        return Found([_the_file(root, cfg)], Skipped())
    paths, skipped = listed_files(root, cfg)
    sources = []
    for path in paths:
        source = _source(path, cfg)
        if not source.bytes:
            skipped.empty += 1
        elif source.format == "text" and not_text(path):
            skipped.not_text.append(path.relative_to(root).as_posix())
        else:
            sources.append(source)
    if not sources:
        keys = skipped.keys()
        raise DataError(
            f"prepare.input={cfg.input}: the corpus is empty ("
            + (f"skipped {skipped.summary()}" if skipped.total() else "no files")
            + "); point it at text, JSONL or Parquet files"
            + (f", or change {' or '.join(keys)}" if keys else "")
        )
    return Found(sources, skipped)


def _the_file(path: Path, cfg: PrepareConfig) -> Source:
    """``prepare.input`` naming one file: read as it is typed, so it must have bytes, and if typed
    text, look like text; the keys that pick a folder's files would do nothing."""
    picking = {"prepare.include": cfg.include, "prepare.exclude": cfg.exclude, "prepare.hidden": cfg.hidden}
    if unread := [key for key, value in picking.items() if value]:
        one = len(unread) == 1
        raise DataError(
            f"{' and '.join(unread)} pick{'s' if one else ''} a folder's files, but prepare.input={cfg.input} "
            f"is a file; remove {'it' if one else 'them'}"
        )
    source = _source(path, cfg)
    if not source.bytes:
        raise DataError(
            f"prepare.input={cfg.input}: the corpus is empty (an empty file); point it at text, JSONL or Parquet files"
        )
    if source.format == "text" and (why := not_text(path)):
        raise DataError(
            f"prepare.input={cfg.input}: not text ({why}); point it at text, JSONL or Parquet files, "
            "or set prepare.format to its format"
        )
    return source


def _source(path: Path, cfg: PrepareConfig) -> Source:
    try:
        size = path.stat().st_size
    except OSError:  # a dangling link in a folder: nothing to read, like an empty file
        size = 0
    return Source(path, size, cfg.format if cfg.format != "auto" else format_of(path))


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
        f"fix the file, set prepare.format to its format, or leave it out of a folder (prepare.exclude=[{source.path.name}])"
    )
