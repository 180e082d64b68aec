"""The library never depends on hydra: run.py is the only door from config files into it."""

from __future__ import annotations

import ast

from tests.conftest import REPO

FORBIDDEN = {"hydra", "omegaconf"}


def test_library_does_not_import_hydra_or_omegaconf():
    offenders = []
    for package in ("diloco", "outer_opt"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_library_reads_no_environment_variables():
    """No hidden inputs below the entry points (run.py and the worker's main())."""
    # Entry points (the worker's and the fork server's main) and the launcher's modules that
    # pass the environment on to the processes they start.
    allowed = {"diloco/worker.py", "diloco/forkserver.py", "diloco/spawn.py"}
    offenders = []
    for path in sorted((REPO / "diloco").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel not in allowed and ("os.environ" in path.read_text() or "os.getenv" in path.read_text()):
            offenders.append(rel)
    assert not offenders, offenders
