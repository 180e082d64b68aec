"""The repository stands on its own (docs/design.md, invariant 16).

No code, test, config or page points to a document outside the repository or to a numbered
issue; every "docs/design.md, invariant N" (or "code style N") cited anywhere names one that
docs/design.md has; and every test docs/design.md names exists, file and function.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
SUFFIXES = {".py", ".md", ".yaml", ".yml"}
# What runs leave behind (git ignores them), and tool caches: not the repository's own text.
SKIPPED_DIRS = {".git", "outputs", "multirun", "wandb", "__pycache__", ".pytest_cache", ".ruff_cache", "node_modules"}
SKIPPED_PATHS = {"experiments/results", "corpus"}

# Spelled in pieces so that this file does not match itself.
_DESIGN, _STYLE, _SHARED = "DESIGN", "STYLE", "shared"
OUTSIDE = re.compile(
    "|".join(
        [
            _DESIGN + r"(?:\s+(?:invariants?|sections?|rules?)\b|\.md)",
            _STYLE + r"(?:\s+rules?\b|\.md)",
            r"\.\./" + _SHARED,
            r"\bissues?\s*#?\s*\d+",
        ]
    ),
    re.IGNORECASE,
)
_CASED = re.compile(_DESIGN + "|" + _STYLE)  # the outside documents' names are upper case; docs/design.md is not
NUMBERS = r"(\d+(?:(?:\s*,\s*and\s+|\s*,\s*|\s+and\s+)\d+)*)"
# "docs/design.md, invariant 6", "[docs/design.md](docs/design.md#invariants), invariants 3 and 4",
# "docs/design.md, code style 4"; a comment may carry the number to its next line.
CITED = re.compile(r"design\.md(?:\]\([^)\s]*\))?,[\s#]+(invariants?|code style)[\s#]+" + NUMBERS)
NAMED_TEST = re.compile(r"`(tests/[\w/]+\.py)::([\w:]+)`")


def repository_files() -> Iterator[Path]:
    for folder, dirs, files in os.walk(REPO):
        here = Path(folder)
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIPPED_DIRS
            and not d.endswith(".egg-info")
            and (here / d).relative_to(REPO).as_posix() not in SKIPPED_PATHS
        )
        for name in sorted(files):
            if Path(name).suffix in SUFFIXES:
                yield here / name


def outside_references(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each reference to a document outside the repository or to an issue."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in OUTSIDE.finditer(line):
            if match.group(0).lower().startswith("issue") or _CASED.match(match.group(0)) or "/" in match.group(0):
                found.append((number, line.strip()))
                break
    return found


def design_sections() -> dict[str, set[int]]:
    """The numbered items of docs/design.md's "Invariants" and "Code style" sections."""
    items: dict[str, set[int]] = {"invariant": set(), "code style": set()}
    section = None
    for line in DESIGN.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = {"## Invariants": "invariant", "## Code style": "code style"}.get(line.strip())
        elif section and (item := re.match(r"(\d+)\. \*\*", line)):
            items[section].add(int(item.group(1)))
    return items


def citations(text: str) -> list[tuple[str, int]]:
    """(kind, number) of every "docs/design.md, invariant(s) N" and "docs/design.md, code style N"."""
    return [(kind.rstrip("s"), int(n)) for kind, numbers in CITED.findall(text) for n in re.findall(r"\d+", numbers)]


@cache
def defined_names(path: Path) -> frozenset[str]:
    """The module's functions and classes, and each class's methods as ``Class::method``."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(
                f"{node.name}::{m.name}" for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    return frozenset(names)


def test_the_patterns_catch_each_outside_form_and_nothing_of_the_repositorys_own():
    outside = [
        _DESIGN + " invariant 6",
        "(" + _DESIGN + " section 2)",
        _DESIGN + ".md's invariants",
        _STYLE + " rule 4",
        "see ../" + _SHARED + "/notes",
        "(is" + "sue 33)",
        "Is" + "sue 32: a file",
        "is" + "sues #12 and 13",
    ]
    assert [n for n, text in enumerate(outside) if not outside_references(text)] == []
    own = [
        "docs/design.md, invariant 6",
        "a restarted lighthouse issues ids above every asker's",
        "the design of the outer step",
    ]
    assert [text for text in own if outside_references(text)] == []
    cited = "(docs/design.md, invariants 1, 9 and 10) [docs/design.md](docs/design.md#invariants), invariant 6"
    assert citations(cited + " docs/design.md,\n    # code style 7") == [
        ("invariant", 1),
        ("invariant", 9),
        ("invariant", 10),
        ("invariant", 6),
        ("code style", 7),
    ]


def test_nothing_points_outside_the_repository():
    files = list(repository_files())
    assert DESIGN in files and Path(__file__).resolve() in files
    problems = [
        f"{path.relative_to(REPO)}:{number}: {line}"
        for path in files
        for number, line in outside_references(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert not problems, (
        "point into the repository (docs/design.md, invariant N) or say what was meant instead:\n" + "\n".join(problems)
    )


def test_every_cited_invariant_and_code_style_point_exists():
    defined = design_sections()
    assert defined["invariant"] == set(range(1, len(defined["invariant"]) + 1)), "invariants numbered 1, 2, ..."
    assert defined["code style"] == set(range(1, len(defined["code style"]) + 1)), "code style numbered 1, 2, ..."
    cited = {
        (path.relative_to(REPO).as_posix(), kind, number)
        for path in repository_files()
        for kind, number in citations(path.read_text(encoding="utf-8", errors="replace"))
    }
    assert ("README.md", "invariant", 6) in cited, "README's exit-0 promise points at docs/design.md, invariant 6"
    missing = sorted(f"{path}: {kind} {number}" for path, kind, number in cited if number not in defined[kind])
    assert not missing, f"docs/design.md has no such item: {missing}"


def test_every_test_the_design_names_exists():
    text = DESIGN.read_text(encoding="utf-8")
    named = NAMED_TEST.findall(text)
    assert len(named) >= len(design_sections()["invariant"])
    missing = []
    for file, name in named:
        path = REPO / file
        if not path.is_file():
            missing.append(f"{file} (no such file)")
        elif name not in defined_names(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/design.md names tests that do not exist: {missing}"
    invariants = text.split("## Invariants", 1)[1].split("\n## ", 1)[0]
    untested = [
        item.group(1)
        for item in re.finditer(r"^(\d+)\. \*\*(.*?)(?=^\d+\. \*\*|\Z)", invariants, re.MULTILINE | re.DOTALL)
        if not NAMED_TEST.search(item.group(0))
    ]
    assert not untested, f"every invariant names a test that keeps it; these name none: {untested}"
