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
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from diloco.config.base import to_dict
from diloco.config.job import JobConfig, job_config_from_dict
from diloco.files import write_atomically
from diloco.run_paths import RunPaths

BASE_CONFIG = "base_config"
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


SWEEP_COLUMNS = ("job", "overrides", "ok", "final eval loss", "bytes/token", "wall s")


def write_sweep_table(sweep_dir: Path) -> None:
    """``sweep.md`` in the sweep directory: one row per finished job, rewritten as each one ends
    (jobs run one after another: a job folder without a summary is one that failed before it ran)."""
    rows = []
    for saved in sorted(sweep_dir.glob("*/.hydra/overrides.yaml"), key=lambda p: (len(p.parts[-3]), p.parts[-3])):
        job_dir = saved.parent.parent  # hydra writes each job's own overrides there
        cells = (job_dir.name, " ".join(OmegaConf.load(saved)) or "(none)")
        summary_path = RunPaths(job_dir).summary
        if not summary_path.is_file():
            rows.append(cells + ("no", "–", "–", "–"))
            continue
        summary = json.loads(summary_path.read_text())
        cells += ("yes" if summary["ok"] else "no", f"{summary['final_eval_loss']:.4f}")
        rows.append(cells + (f"{summary['bytes_per_token']:.1f}", f"{summary['wall_seconds']:.0f}"))
    lines = ["| " + " | ".join(SWEEP_COLUMNS) + " |", "|" + "---|" * len(SWEEP_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    write_atomically(sweep_dir / "sweep.md", lambda fh: fh.write(("\n".join(lines) + "\n").encode()))


def output_folder_problem(argv: list[str]) -> str | None:
    """Why hydra could not make the job's output folder, or the job could not write in it (a file
    in its path, a read-only file system, no permission): hydra makes it before ``main`` runs and
    would stop with its own traceback."""
    mode = "sweep" if {"-m", "--multirun"} & set(argv) else "run"
    key = f"hydra.{mode}.dir"
    given = [arg.split("=", 1)[1] for arg in argv if arg.lstrip("+").startswith(f"{key}=")]
    default = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["hydra"][mode]["dir"]
    folder = given[-1] if given else default
    known = folder.split("${", 1)[0]  # what is fixed before hydra resolves the rest
    if "${" in folder:
        known = known.rsplit("/", 1)[0] if "/" in known else ""
    if not folder.strip():  # hydra would write the run into the current directory
        return f"error: {key}='': names no folder; pick one for the run's outputs, e.g. {key}=outputs/run1"
    try:
        existing = next(part for part in (Path(known), *Path(known).parents) if part.exists())
        if not existing.is_dir():
            return f"error: {key}={folder}: {existing} is a file, not a folder; pick another {key}"
        reason = unwritable_folder(Path(known))
    except OSError as error:  # a name too long, say
        reason = error.strerror or str(error)
    if reason:
        return f"error: {key}={folder}: cannot create or write {Path(known)} ({reason}); pick another {key}"
    return None


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
