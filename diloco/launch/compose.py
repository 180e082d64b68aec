"""``conf/`` composed with hydra: the one module of the package that speaks hydra or OmegaConf.

``run.py``, the tests and the experiments compose the job here; what comes out is a plain dict
(``compose_raw``) or the typed, validated ``JobConfig`` (``compose_job``), so nothing below
this module sees a ``DictConfig``. The files a run keeps in hydra's formats are read and
written here too: its ``config.yaml``, and in a ``-m`` sweep ``sweep.md`` from every job's
``.hydra/overrides.yaml``.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from hydra.errors import CompactHydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from diloco.config.base import closest, key_paths, to_dict
from diloco.config.job import JobConfig, job_config_from_dict
from diloco.files import write_atomically
from diloco.run_paths import RunPaths

BASE_CONFIG = "base_config"
HYDRA_RUN_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what hydra writes in .hydra/ as a job starts
RESOLVED_CONFIG = "config.yaml"  # the run's resolved config, written beside them before the job starts
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the checkout's conf/, beside run.py

# Keys left out of the base: absent, they follow another key. ``model.vocab_size`` is the
# data's (``job_config_from_dict``); a user sets it with ``+model.vocab_size=N``.
DERIVED_KEYS = (("model", "vocab_size"),)


def base_config() -> dict[str, Any]:
    """Every default of ``JobConfig``: the node ``conf/config.yaml`` lists first, so a preset
    holds only its deltas, a default is written once (in its dataclass, lingua's habit), and
    ``algo.sync_every=10`` overrides a key no preset mentions while an unknown key is refused.

    A plain dict, not the dataclass: OmegaConf cannot type ``Literal`` fields, and
    ``job_config_from_dict`` checks every type with messages that name the key and the fix.
    """
    base = to_dict(JobConfig())
    for section, key in DERIVED_KEYS:
        del base[section][key]
    return base


@functools.cache  # the dataclass defaults do not change within a process; storing costs 8 ms a compose
def store_base_config() -> None:
    """Register ``base_config`` with hydra's ConfigStore; call before composing ``conf/``."""
    ConfigStore.instance().store(name=BASE_CONFIG, node=base_config())


def compose_job(overrides: list[str]) -> JobConfig:
    """The ``JobConfig`` ``python run.py *overrides`` would build."""
    return job_config_from_dict(compose_raw(overrides))


def compose_raw(overrides: list[str]) -> dict[str, Any]:
    """The plain config dict ``python run.py *overrides`` would see (hydra's own node removed):
    for tests and experiments, which compose ``conf/`` without hydra's command line."""
    return plain_config(compose_config(overrides))


def compose_config(overrides: list[str]) -> DictConfig:
    """``conf/`` composed with ``overrides`` as hydra hands it to ``main``, interpolations unresolved."""
    store_base_config()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """A composed config as the plain, resolved dict ``job_config_from_dict`` reads (no hydra node)."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("hydra", None)
    return raw


def to_yaml(raw: dict[str, Any]) -> str:
    """A run's ``config.yaml``: the composed config, as ``load_saved_config`` reads it back."""
    return OmegaConf.to_yaml(raw)


def load_saved_config(path: Path) -> dict[str, Any]:
    """The plain dict a run's ``config.yaml`` holds."""
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


class SweepJobFailed(CompactHydraException):
    """A job of a ``-m`` sweep failed: hydra runs the others, then exits 1 with the first one's
    reason (hydra prints a CompactHydraException as its message alone)."""


SWEEP_COLUMNS = ("job", "overrides", "ok", "rounds", "final eval loss", "bytes/token", "wall s")


def write_sweep_table(sweep_dir: Path) -> Path:
    """``sweep.md`` in the sweep directory: one row per finished job, rewritten as each one ends
    (jobs run one after another: a job folder without a summary is one that failed before it ran)."""
    rows = []
    for saved in sorted(sweep_dir.glob("*/.hydra/overrides.yaml"), key=lambda p: (len(p.parts[-3]), p.parts[-3])):
        job_dir = saved.parent.parent  # hydra writes each job's own overrides there
        cells = (job_dir.name, " ".join(OmegaConf.load(saved)) or "(none)")
        summary_path = RunPaths(job_dir).summary
        if not summary_path.is_file():
            rows.append(cells + ("no", "–", "–", "–", "–"))
            continue
        summary = json.loads(summary_path.read_text())
        cells += ("yes" if summary["ok"] else "no", str(summary["rounds"]), f"{summary['final_eval_loss']:.4f}")
        rows.append(cells + (f"{summary['bytes_per_token']:.1f}", f"{summary['wall_seconds']:.0f}"))
    lines = ["| " + " | ".join(SWEEP_COLUMNS) + " |", "|" + "---|" * len(SWEEP_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    table = sweep_dir / "sweep.md"
    write_atomically(table, lambda fh: fh.write(("\n".join(lines) + "\n").encode()))
    return table


EVERY_KEY = "every key: docs/configuration.md"
# Flags after which the arguments are not this job's keys (another primary config, a saved run to
# rerun, shell completion's query): run.py checks none of them.
UNCHECKED_FLAGS = (
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "--experimental-rerun",
    "-sc",
    "--shell-completion",
)


def key_problem_on_command_line(argv: list[str]) -> str | None:
    """The one-line refusal of an override naming no key of the job (``trainer.max_step=100``) or
    no preset of its ``conf/`` group (``model=smal``), with the closest one, or None. Checked before
    hydra, which would advise appending the key with ``+`` (the wrong fix) or print its search path."""
    if any(arg.split("=", 1)[0] in UNCHECKED_FLAGS for arg in argv):
        return None
    given = [arg for arg in argv if not arg.startswith("-") and ("=" in arg or arg.startswith("~"))]
    try:
        overrides = OverridesParser.create().parse_overrides(given)
    except OverrideParseException:
        return None  # hydra names what it cannot parse
    keys = frozenset(key_paths(JobConfig))
    for override in overrides:
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or override.package is not None:
            continue  # hydra's own keys; a config placed with @package is hydra's to check
        if key in conf_groups():
            problem = preset_problem(key, override) or group_prefix_problem(key, override)
        else:
            problem = None if key in keys else unknown_key_line(key, keys)
        if problem:
            return problem
    return None


@functools.cache
def conf_groups() -> dict[str, tuple[str, ...]]:
    """Every group of ``conf/`` and its presets (``model`` -> ``tiny``, ``small``, ...)."""
    return {
        group.name: tuple(sorted(p.stem for p in group.glob("*.yaml")))
        for group in sorted(CONF_DIR.iterdir())
        if group.is_dir()
    }


def preset_problem(group: str, override: Override) -> str | None:
    """Why ``group=choice`` names no preset of ``conf/<group>/``, or None; a value that is not a
    preset's name (``null``, a mapping of keys, a glob) is hydra's to read."""
    if override.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
        choices = list(override.sweep_string_iterator())
    elif override.value_type == ValueType.ELEMENT and isinstance(override.value(), str):
        choices = [override.value()]
    else:
        return None
    presets = conf_groups()[group]
    for choice in choices:
        if choice not in presets and choice != "null" and "${" not in choice:
            typed = override.get_key_element()  # +experiment: as the user wrote it
            guess = closest(choice, presets)
            hint = f"; did you mean {typed}={guess}?" if guess else ""
            return f"error: {typed}={choice} is not a preset of conf/{group}/{hint} (presets: {', '.join(presets)})"
    return None


def group_prefix_problem(group: str, override: Override) -> str | None:
    """Why a preset is chosen with the wrong prefix, or None: ``model=`` is in ``conf/config.yaml``'s
    defaults, so it is changed without ``+``; ``experiment`` is not, so it is added with one."""
    if not isinstance(override.value(), str) or override.is_delete():
        return None  # a mapping of keys (+algo={sync_every:10}) or a deletion: hydra's to read
    chosen = group in default_presets()
    wanted = f"{group}={override.value()}" if chosen else f"+{group}={override.value()}"
    if override.get_key_element() == wanted.split("=", 1)[0]:
        return None
    reason = f"conf/config.yaml chooses {group}={default_presets()[group]}" if chosen else f"no {group} is chosen"
    return f"error: {override.input_line}: {reason} by default; write {wanted}"


@functools.cache
def default_presets() -> dict[str, str]:
    """The presets ``conf/config.yaml``'s defaults list chooses (``model`` -> ``tiny``)."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["defaults"]
    return {group: preset for entry in defaults if isinstance(entry, dict) for group, preset in entry.items()}


def unknown_key_line(key: str, keys: frozenset[str]) -> str:
    """``error: trainer.max_step is not a key; did you mean trainer.max_steps? (every key: ...)``."""
    if guesses := suggested_keys(key, keys):
        return f"error: {key} is not a key; did you mean {' or '.join(guesses)}? ({EVERY_KEY})"
    parent = key.rpartition(".")[0]
    parent = parent if parent in keys else ""
    names = sorted(k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent)
    where = f"the keys of {parent}" if parent else "the top-level keys"
    return f"error: {key} is not a key ({where}: {', '.join(names)}; {EVERY_KEY})"


def suggested_keys(key: str, keys: frozenset[str]) -> list[str]:
    """What a mistyped ``key`` most likely meant: a near spelling (``cluster.group`` -> ``cluster.groups``),
    else the keys of that name in other sections (``trainer.lr`` -> ``inner_opt.lr or outer_opt.lr``),
    else a looser spelling (``faults.kill`` -> ``faults.kill_every``)."""
    peers = [k for k in keys if k.count(".") == key.count(".")]
    if near := closest(key, peers, cutoff=0.85):
        return [near]
    name = key.rpartition(".")[2]
    if 0 < len(same_name := sorted(k for k in keys if k.rpartition(".")[2] == name)) <= 3:
        return same_name
    return [loose] if (loose := closest(key, peers, cutoff=0.75)) else []


def output_folder_problem(argv: list[str]) -> str | None:
    """Why hydra could not make the job's output folder, or the job could not write in it (a file
    in its path, a read-only file system, no permission): hydra makes it before ``main`` runs and
    would stop with its own traceback."""
    key, folder = given_output_folder(argv)
    known = fixed_part(folder)
    if not folder.strip():  # hydra would write the run into the current directory
        return f"error: {key}='': names no folder; pick one for the run's outputs, e.g. {key}=outputs/run1"
    try:
        existing = next(part for part in (known, *known.parents) if part.exists())
        if not existing.is_dir():
            return f"error: {key}={folder}: {existing} is a file, not a folder; pick another {key}"
        reason = unwritable_folder(known)
    except OSError as error:  # a name too long, say
        reason = error.strerror or str(error)
    if reason:
        return f"error: {key}={folder}: cannot create or write {known} ({reason}); pick another {key}"
    return None


def given_output_folder(argv: list[str]) -> tuple[str, str]:
    """``hydra.run.dir`` (``hydra.sweep.dir`` with ``-m``) and the folder it names, from the command
    line or ``conf/config.yaml``, unresolved."""
    mode = "sweep" if {"-m", "--multirun"} & set(argv) else "run"
    key = f"hydra.{mode}.dir"
    given = [arg.split("=", 1)[1] for arg in argv if arg.lstrip("+").startswith(f"{key}=")]
    default = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["hydra"][mode]["dir"]
    return key, given[-1] if given else default


def fixed_part(folder: str) -> Path:
    """What of an output folder is fixed before hydra resolves the rest: ``outputs`` of
    ``outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}``, the whole of ``runs/x``."""
    known = folder.split("${", 1)[0]
    if "${" in folder:
        known = known.rsplit("/", 1)[0] if "/" in known else ""
    return Path(known)


def existing_ancestor(argv: list[str]) -> Path:
    """The deepest folder on the way to the run's output folder that exists before hydra makes the
    rest (absolute; the folder itself when it exists): what a refused run must leave as it was."""
    known = Path(os.path.abspath(fixed_part(given_output_folder(argv)[1])))  # as hydra makes its folder absolute
    return next(part for part in (known, *known.parents) if part.is_dir())


def remove_unused_run_folder(
    folder: Path, kept: Path, hydra_subdir: str | None, hydra_log: str, *, said_too: bool = False
) -> None:
    """Undo the output folder hydra made for a run that left nothing of its own (refused, or a
    ``role=sample`` whose text went to stdout): ``folder`` goes if it holds hydra's own files alone
    (``.hydra/``, an empty log, or with ``said_too`` one with the console's lines) and the resolved
    ``config.yaml`` written before the job starts, then the folders made for it that are left empty,
    up to ``kept`` (``existing_ancestor``), which stays. Files are removed by name and folders only
    when empty, so nothing written meanwhile is lost."""
    if kept not in folder.parents or not holds_only_hydra_files(folder, hydra_subdir, hydra_log, said_too):
        return
    try:
        if hydra_subdir and (folder / hydra_subdir).is_dir():
            for name in HYDRA_RUN_FILES:
                (folder / hydra_subdir / name).unlink(missing_ok=True)
            (folder / hydra_subdir).rmdir()
        for name in (hydra_log, RESOLVED_CONFIG):
            (folder / name).unlink(missing_ok=True)
        for made in (folder, *folder.parents[: folder.parents.index(kept)]):
            made.rmdir()
    except OSError:  # something else is there after all (another run's folder beside it): it stays
        return


def holds_only_hydra_files(folder: Path, hydra_subdir: str | None, hydra_log: str, said_too: bool = False) -> bool:
    """Whether ``folder`` holds nothing but what hydra writes as a job starts: its config files in
    ``hydra_subdir`` and an empty ``hydra_log`` (a line said there, or any other file, is the run's,
    but with ``said_too``), and the resolved ``config.yaml`` written before anything else."""
    for entry in folder.iterdir():
        if entry.is_symlink():
            return False
        if entry.name == hydra_log:
            hydra_made = entry.is_file() and (said_too or entry.stat().st_size == 0)
        elif entry.name == hydra_subdir:
            hydra_made = entry.is_dir() and all(p.name in HYDRA_RUN_FILES and p.is_file() for p in entry.iterdir())
        else:
            hydra_made = entry.name == RESOLVED_CONFIG and entry.is_file()
        if not hydra_made:
            return False
    return True


def unwritable_folder(folder: Path) -> str | None:
    """Why ``folder`` cannot be made or written in (the OS's reason), else None. Tried for real, as
    root too (whom permission bits do not stop, a read-only mount does): the missing folders are
    made and a file written, then both removed again, so hydra makes the folder as before."""
    made: list[Path] = []
    try:
        for part in reversed((folder, *folder.parents)):
            if not part.exists():
                part.mkdir()
                made.append(part)
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        return error.strerror or str(error)
    finally:
        for part in reversed(made):
            part.rmdir()
    return None
