"""Writing a run's result files so that they are never torn.

``model.pt``, ``summary.json`` and each group's result are written to a temporary name in
the same folder, flushed to disk, then renamed over the old file: a reader sees either the
previous complete file or the new complete one, and a full disk leaves the previous file
whole and raises an error that says which file could not be written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


class OutputError(OSError):
    """A result file could not be written; the previous version, if any, is untouched."""


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        kept = "the previous version is untouched" if path.exists() else "no previous version exists"
        raise OutputError(f"could not write {path}: {error.strerror or error}; {kept}") from error


def write_json_atomically(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2).encode()
    write_atomically(path, lambda fh: fh.write(text))


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda fh: fh.write(text.encode()))


@contextlib.contextmanager
def writing(path: Path, kept: str = "") -> Iterator[None]:
    """Turn an ``OSError`` raised while writing ``path`` in place (an append, a lock file's pid)
    into an ``OutputError`` that names the file (and ``kept``: what of it survives)."""
    try:
        yield
    except OSError as error:
        if isinstance(error, OutputError):
            raise
        raise OutputError(f"could not write {path}: {error.strerror or error}{kept and '; ' + kept}") from error


def append_text(path: Path, text: str) -> None:
    """Append ``text`` (whole lines) to the records in ``path``; a full disk raises ``OutputError`` naming the file."""
    with writing(path, "the records before are kept"), path.open("a") as fh:
        fh.write(text)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks (a model need not fit in memory twice)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
