"""Layering: one door to hydra, and the library's layers depend on each other one way only.

``run.py`` and ``diloco/launch/compose.py`` are the only doors from config files into the
library; nothing imports run.py. Inside, imports run launch -> prepare -> worker -> library -> outer
-> train -> ft -> config -> leaves (docs/architecture.md), a group's processes never load the lighthouse
server, and ``diloco`` and ``outer_opt`` import each other in no circle. The import graph is read
from the source with ``ast`` (what ``import`` would run: lazy imports inside functions count,
``if TYPE_CHECKING:`` blocks do not).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

FORBIDDEN = {"hydra", "omegaconf"}
PACKAGES = ("diloco", "outer_opt")
# The one module below run.py that speaks hydra: it composes conf/ for run.py, tests and experiments.
HYDRA_DOOR = "diloco/launch/compose.py"

# The layers of diloco/, top to bottom (docs/architecture.md; docs/design.md, invariant 14): a module
# may import its own layer and those below it, never one above. ``leaf`` is diloco/'s root: small
# shared modules (paths, files, exit codes) that import only each other; ``config`` holds every
# config dataclass and imports only itself, the leaves and outer_opt's config. ``prepare``
# (role=prepare: a corpus into tokens) sits just below launch: it uses train's data errors and
# config's metadata, and nothing trains. ``library`` (DiLoCo around one's own loop) builds the outer
# layer from plain parts; the worker builds its own through it.
LAYERS = ("launch", "prepare", "worker", "library", "outer", "train", "ft", "config", "leaf")
# outer_opt (the outer optimizers) sits beside the layers: ft (a healing group's optimizer state),
# outer and config import it, and it imports only diloco's config helpers and the outer schedule (μ's ramp).
OUTER_OPT_MAY_LOAD = ("outer_opt", "diloco.config.base", "diloco.schedule")
LIGHTHOUSE_SERVER = "diloco.ft.lighthouse"
# A group's processes: the worker and the groups' side of the fault-tolerance layer.
GROUP_SIDE = (
    "diloco.worker.entry",
    "diloco.ft.client",
    "diloco.ft.manager",
    "diloco.ft.lanes",
    "diloco.ft.state",
    "diloco.ft.transport",
    "diloco.ft.protocol",
)
# Modules both packages load: each imports neither package, so it closes no circle (``diloco``
# and ``diloco.config`` are packages whose __init__ holds only a docstring).
SHARED_LEAVES = {"diloco", "diloco.config", "diloco.config.base", "diloco.schedule"}


def layer_of(module: str) -> str:
    """``diloco.outer.codecs`` -> ``outer``; diloco/'s own modules -> ``leaf``; outer_opt -> ``outer_opt``."""
    parts = module.split(".")
    if parts[0] == "outer_opt":
        return "outer_opt"
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "leaf"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's tree, parsed once for every test of this module (the files do not change under them)."""
    return ast.parse(path.read_text())


def library_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def imported_names(tree: ast.AST, this: str, is_package: bool, type_hints: bool = False) -> Iterator[str]:
    """Every module name an import statement names (``from a import b`` names ``a`` and ``a.b``);
    with ``type_hints``, those of ``if TYPE_CHECKING:`` blocks too (never run, but still an arrow).
    A package's ``__getattr__`` (its public names, loaded on their first use: ``from diloco import
    DiLoCo``) is no arrow: importing the package or a module in it never runs it."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and is_package:
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            kept = node.body + node.orelse if type_hints else node.orelse
            yield from imported_names(ast.Module(body=kept, type_ignores=[]), this, is_package, type_hints)
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = this.split(".") if is_package else this.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)
        yield from imported_names(node, this, is_package, type_hints)


def import_graph(with_parents: bool = True, type_hints: bool = False) -> dict[str, set[str]]:
    """Library module -> the library modules importing it loads (a copy: the tests may change theirs)."""
    return {module: set(targets) for module, targets in _import_graph(with_parents, type_hints).items()}


@functools.cache
def _import_graph(with_parents: bool, type_hints: bool) -> dict[str, set[str]]:
    """Library module -> the library modules importing it loads.

    ``with_parents``: a module loads its parent packages too (their ``__init__``). Left out to
    look for cycles: a package's ``__init__`` importing its own modules is the usual layout.
    ``type_hints``: count the imports of ``if TYPE_CHECKING:`` blocks too.
    """
    modules = library_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(parsed(path), name, path.name == "__init__.py", type_hints):
            parts = imported.split(".")
            targets |= {".".join(parts[:i]) for i in range(1 if with_parents else len(parts), len(parts) + 1)}
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)} if with_parents else set()
        graph[name] = ((targets & modules.keys()) | parents) - {name}
    return graph


def chains_from(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` loads, with one import chain that gets there."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        current = todo.pop()
        for target in sorted(graph[current]):
            if target not in chains:
                chains[target] = chains[current] + [target]
                todo.append(target)
    return chains


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_only_the_compose_module_imports_hydra_or_omegaconf():
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if str(path.relative_to(REPO)) == HYDRA_DOOR:
                continue
            for node in ast.walk(parsed(path)):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_nothing_imports_run_py():
    """run.py is the entry point alone: the library, the tests and the experiments import the package."""
    offenders = []
    for folder in (*PACKAGES, "tests", "experiments"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(parsed(path)):
                if isinstance(node, ast.Import) and any(a.name == "run" for a in node.names):
                    offenders.append(str(path.relative_to(REPO)))
                elif isinstance(node, ast.ImportFrom) and node.module == "run" and not node.level:
                    offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


def test_experiments_import_the_installed_package_and_edit_no_sys_path():
    offenders = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "experiments").rglob("*.py"))
        if "sys.path" in path.read_text()
    ]
    assert not offenders, offenders


def test_library_reads_no_environment_variables():
    """No hidden inputs below the entry points (run.py and the worker's main())."""
    # Entry points (the worker's and the fork server's main) and the launcher's modules that
    # pass the environment on to the processes they start.
    # DiLoCo and init_group (diloco/library/) are the entries of a user's own script, which torchrun starts.
    allowed = {
        "diloco/worker/entry.py",
        "diloco/launch/forkserver.py",
        "diloco/launch/spawn.py",
        "diloco/launch/script_groups.py",
        "diloco/library/group.py",
        "diloco/library/loop.py",
        "diloco/huge_pages.py",  # run.py's default for torch (THP_MEM_ALLOC_ENABLE), set before torch loads
    }
    offenders = []
    for path in sorted((REPO / "diloco").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel not in allowed and ("os.environ" in path.read_text() or "os.getenv" in path.read_text()):
            offenders.append(rel)
    assert not offenders, offenders


def test_every_import_points_down_the_layers():
    """launch -> worker -> library -> outer -> train -> ft -> config -> leaves: no arrow points back up, so
    train/ and outer/ never import worker/ or launch/, ft/ never imports train/ or outer/, and
    config/ imports no runtime code."""
    graph = import_graph(with_parents=False, type_hints=True)
    assert {layer_of(m) for m in graph} >= set(LAYERS) | {"outer_opt"}, sorted(graph)
    upward = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        for target in sorted(targets):
            there = layer_of(target)
            if here == "outer_opt":
                allowed = within(target, OUTER_OPT_MAY_LOAD)
            elif there == "outer_opt":
                allowed = LAYERS.index(here) <= LAYERS.index("config")
            else:
                allowed = LAYERS.index(there) >= LAYERS.index(here)
            if not allowed:
                upward.append(f"{module} ({here}) imports {target} ({there})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_reading_a_config_or_serving_the_lighthouse_loads_no_trainer_synchronizer_or_worker():
    """The job config is plain dataclasses, and the lighthouse process reads it and serves quorums:
    neither loads the training side (the lighthouse needs no model)."""
    graph = import_graph()
    training_side = ("diloco.train", "diloco.outer", "diloco.worker")
    for start, may_not in (
        ("diloco.config.job", training_side + ("diloco.ft", "diloco.launch")),
        ("diloco.launch.lighthouse_process", training_side),
    ):
        loaded = chains_from(graph, start)
        offenders = [" -> ".join(chain) for target, chain in loaded.items() if within(target, may_not)]
        assert not offenders, f"{start} loads:\n" + "\n".join(offenders)


def test_a_groups_processes_never_load_the_lighthouse_server():
    graph = import_graph()
    offenders = [
        " -> ".join(chain)
        for module in GROUP_SIDE
        for target, chain in chains_from(graph, module).items()
        if target == LIGHTHOUSE_SERVER
    ]
    assert not offenders, "the server module is the lighthouse's alone; loaded by:\n" + "\n".join(offenders)


def test_no_import_cycle_between_modules():
    """Not even one closed by a type hint alone."""
    cycle = find_cycle(import_graph(with_parents=False, type_hints=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_diloco_and_outer_opt_import_each_other_in_no_circle():
    """At package level; ``SHARED_LEAVES`` (used by both, importing neither) count as their own package."""
    graph = import_graph()
    for leaf in SHARED_LEAVES:
        assert graph[leaf] <= SHARED_LEAVES, f"{leaf} must import neither package to be shared: {sorted(graph[leaf])}"

    def package(module: str) -> str:
        return f"module {module}" if module in SHARED_LEAVES else f"package {module.split('.')[0]}"

    edges: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], str] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = package(module), package(target)
            if a != b:
                edges.setdefault(a, set()).add(b)
                witness.setdefault((a, b), f"{module} imports {target}")
    cycle = find_cycle(edges)
    assert cycle is None, (
        "package cycle " + " -> ".join(cycle) + ": " + "; ".join(witness[(a, b)] for a, b in zip(cycle, cycle[1:]))
    )


@pytest.mark.slow
def test_the_launcher_leaves_fsdp_dtensor_and_dynamo_to_the_workers(tmp_path):
    """``python run.py`` checks its job without FSDP's, DTensor's, DCP's or TorchDynamo's imports
    (each about a second): only a worker shards, only a checkpoint writes with DCP, and the
    model the launcher counts and signs is never initialised (on the meta device that imports
    TorchDynamo)."""
    heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint", "torch._dynamo")
    probe = (
        "import sys; from diloco.launch.compose import compose_job; from diloco.run_paths import RunPaths; "
        "from diloco.worker.builders import preflight; "
        f"preflight(compose_job([]), RunPaths({str(tmp_path)!r})); "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]", loaded.stdout
