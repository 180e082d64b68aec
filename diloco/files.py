"""Writing a run's result files so that they are never torn.

``model.pt``, ``summary.json`` and each group's result are written to a temporary name in
the same folder, flushed to disk, then renamed over the old file: a reader sees either the
previous complete file or the new complete one, and a full disk leaves the previous file
whole and raises an error that says which file could not be written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
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


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks (a model need not fit in memory twice)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
