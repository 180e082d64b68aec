"""Which files of a ``prepare.input`` folder are read, and why the others are not.

A folder such as a repository checkout holds images, archives, build outputs and ``.git`` beside
its text; each is skipped and counted, never fatal. In order: hidden files and folders (a name
starting with ``.``) unless ``prepare.hidden``; files outside ``prepare.include`` or inside
``prepare.exclude``; empty files; and files typed text that are not text by the cheap rule
``not_text`` states. JSONL and Parquet files are typed by their suffix and read as they are.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diloco.config.prepare import PrepareConfig

COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # datasets reads these through fsspec; the format is the suffix before
SNIFF_KB = 8  # a text file's first this many KB decide whether it is text: one read, whatever its size
NAMED = 3  # skipped files named in a line; the rest are counted


def not_text(path: Path) -> str | None:
    """Why ``path`` is not read as text, else None: a NUL byte or invalid UTF-8 in its first
    ``SNIFF_KB`` KB (decompressed, for a compressed file), or a file that cannot be read. Text
    has no NUL, and ``datasets`` reads text as UTF-8: either would fail the run or feed it noise.
    A file that passes but turns invalid further on still fails the run, naming the file."""
    size = SNIFF_KB << 10
    try:
        head = _head(path, size)
    except (OSError, EOFError, ValueError) as error:  # a dangling link, a corrupt archive
        return f"cannot be read ({type(error).__name__})"
    if b"\0" in head:
        return f"a NUL byte in its first {SNIFF_KB} KB"
    try:  # a character cut at the edge is fine; at the end of the whole file it is not
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < size)
    except UnicodeDecodeError as error:
        return f"not UTF-8 in its first {SNIFF_KB} KB (byte {error.start})"
    return None


def _head(path: Path, size: int) -> bytes:
    if path.name.lower().endswith(COMPRESSED):
        import fsspec  # as datasets opens it: a .gz of text is text

        with fsspec.open(str(path), "rb", compression="infer") as fh:
            return fh.read(size)
    with path.open("rb") as fh:
        return fh.read(size)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` as a regex over a relative POSIX path: ``*`` any characters but ``/``, ``?``
    one, ``[...]`` one of a set (``[!...]``: not of it), ``**`` any number of folders. As in
    .gitignore, a pattern without ``/`` (a trailing one aside) matches a name at any depth:
    ``*.png`` is ``**/*.png``."""
    pattern = pattern.rstrip("/")
    if "/" not in pattern:
        pattern = "**/" + pattern
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] in "*?":
            out.append("[^/]*" if pattern[i] == "*" else "[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) != -1:
            out.append(_char_set(pattern[i + 1 : end]))
            i = end + 1
        else:  # a lone [ too, as fnmatch reads it
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _char_set(body: str) -> str:
    negated = body.startswith("!")
    body = body[1:] if negated else body
    return "[" + ("^" if negated else "") + "".join(c if c == "-" else re.escape(c) for c in body) + "]"


def matches(relative: str, globs: Sequence[re.Pattern[str]]) -> bool:
    """Whether the file at ``relative``, or a folder it is in, matches one of ``globs``: ``docs``
    or ``node_modules`` covers every file under such a folder, as ``docs/**`` does."""
    parts = relative.split("/")
    paths = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    return any(glob.fullmatch(path) for glob in globs for path in paths)


@dataclass
class Skipped:
    """The files of a folder that were not read, by why (paths relative to ``prepare.input``)."""

    not_text: list[str] = field(default_factory=list)
    not_included: int = 0
    excluded: int = 0
    empty: int = 0
    hidden: list[str] = field(default_factory=list)  # a hidden folder once, not each file in it

    def total(self) -> int:
        return len(self.not_text) + self.not_included + self.excluded + self.empty + len(self.hidden)

    def summary(self) -> str:
        """``2 not text (NUL or not UTF-8 in the first 8 KB: docs/logo.png, bin/tool), 1 matching
        prepare.exclude, 1 hidden (.git)``."""
        reasons = [
            (len(self.not_text), f"not text (NUL or not UTF-8 in the first {SNIFF_KB} KB: {_named(self.not_text)})"),
            (self.not_included, "not matching prepare.include"),
            (self.excluded, "matching prepare.exclude"),
            (self.empty, "empty"),
            (len(self.hidden), f"hidden ({_named(self.hidden)})"),
        ]
        return ", ".join(f"{count:,} {why}" for count, why in reasons if count)

    def keys(self) -> list[str]:
        """The keys that would let some skipped file in."""
        reasons = (
            (self.not_included, "prepare.include"),
            (self.excluded, "prepare.exclude"),
            (len(self.hidden), "prepare.hidden"),
        )
        return [key for count, key in reasons if count]


def _named(paths: list[str]) -> str:
    more = len(paths) - NAMED
    return ", ".join(paths[:NAMED]) + (f", +{more:,} more" if more > 0 else "")


def listed_files(root: Path, cfg: PrepareConfig) -> tuple[list[Path], Skipped]:
    """The files under the folder ``root`` that ``prepare.hidden``, ``include`` and ``exclude`` let
    through, in sorted relative order, and what was skipped so far. The output folder (inside
    the input on a second run: its tokens are not text) is neither read nor counted."""
    output = Path(str(cfg.output)).resolve()
    include, exclude = [glob_regex(p) for p in cfg.include], [glob_regex(p) for p in cfg.exclude]
    skipped = Skipped()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        folder = Path(dirpath)
        if not cfg.hidden:
            hidden = sorted(n for n in [*dirnames, *filenames] if n.startswith("."))
            skipped.hidden += [(folder / n).relative_to(root).as_posix() for n in hidden]
            filenames = [n for n in filenames if not n.startswith(".")]
        dirnames[:] = sorted(
            d for d in dirnames if (cfg.hidden or not d.startswith(".")) and (folder / d).resolve() != output
        )
        for name in filenames:
            relative = (folder / name).relative_to(root).as_posix()
            if include and not matches(relative, include):
                skipped.not_included += 1
            elif matches(relative, exclude):
                skipped.excluded += 1
            else:
                files.append(folder / name)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    skipped.hidden.sort()
    return files, skipped
