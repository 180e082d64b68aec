"""Planned stops and whole-job restarts: every worker's shard of its group's state, on disk.

Healing stays live from peers (DESIGN); a checkpoint is for a stop the user asked for
(Ctrl-C, SIGTERM from a scheduler) or for restarting a whole job. Each worker saves only
its own shard (no gather to one rank, no collective between ranks) in one safetensors file
(``diloco.train.tensor_file``: nothing in a checkpoint is unpickled): θ_l, the inner
optimizer's state, θ_g and the outer optimizers' state, plus its position as JSON. Layout in
the run directory::

    checkpoints/step-000500/group-0/rank-0/   one worker's state.safetensors and manifest.json
    checkpoints/step-000500/group-0/complete.json   written last, by the group's leader

A rank's folder is written under a temporary name, flushed to disk and renamed whole;
``manifest.json`` holds every file's size and sha256, so a truncated or altered file is
refused by name; ``complete.json`` appears only once every rank of the group has its folder
in place.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from diloco.config.base import ConfigError
from diloco.files import write_json_atomically
from diloco.run_paths import RunPaths
from diloco.train.tensor_file import TensorFileError, read_layout, read_tensors, write_tensors

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.safetensors"
COMPLETE = "complete.json"
LATEST = "latest"
AUTO = "auto"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from: missing, partial, corrupt, or of another job."""


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def group_dir(checkpoint: Path, group: int) -> Path:
    return checkpoint / f"group-{group}"


def rank_dir(group_folder: Path, rank: int) -> Path:
    return group_folder / f"rank-{rank}"


def save_rank(folder: Path, tensors: dict[str, torch.Tensor], progress: dict[str, Any]) -> None:
    """Write one worker's shard to ``folder`` (a ``rank_dir``), atomically: whole or not at all."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    snapshot = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    with (partial / STATE).open("wb") as file:
        sha256 = write_tensors(file, snapshot)
        file.flush()
        os.fsync(file.fileno())
    files = {STATE: {"bytes": (partial / STATE).stat().st_size, "sha256": sha256}}
    layout = {name: _layout(t.shape, t.dtype) for name, t in snapshot.items()}
    manifest = {"tensors": sorted(snapshot), "layout": layout, "files": files, "progress": progress}
    write_json_atomically(partial / MANIFEST, manifest)
    shutil.rmtree(folder, ignore_errors=True)  # an earlier attempt at the same step
    os.replace(partial, folder)


def mark_complete(group_folder: Path, info: dict[str, Any]) -> None:
    """The group's leader, once every rank's ``save_rank`` returned: the group's checkpoint is whole."""
    write_json_atomically(group_folder / COMPLETE, info | {"time": time.time()})


def load_rank(folder: Path, template: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One worker's shard and its progress, its file checked against the manifest as it is read.

    ``template`` names the tensors this worker holds now (their shapes and dtypes); the
    checkpoint must hold exactly those. Returns new CPU tensors: nothing live is touched
    here, so a refused checkpoint leaves the worker as it was.
    """
    return _load_verified(folder, template, _manifest(folder))


def _load_verified(
    folder: Path, template: dict[str, torch.Tensor], manifest: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    expected, found = sorted(template), manifest["tensors"]
    if expected != found:
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        raise CheckpointError(
            f"{folder}: holds other state than this job's workers (missing {missing[:3]}, unexpected {extra[:3]}); "
            "resume with the model, algo, inner_opt and outer_opt settings the checkpoint was written with"
        )
    path = folder / STATE
    try:
        with path.open("rb") as file:
            loaded, sha256 = read_tensors(file)
    except TensorFileError as error:
        raise CheckpointError(f"{path}: corrupt ({error})") from None
    if sha256 != manifest["files"][STATE]["sha256"]:
        raise _differs(path, folder / MANIFEST)
    for name, tensor in template.items():
        saved = loaded.get(name)
        if saved is None or saved.shape != tensor.shape or saved.dtype != tensor.dtype:
            what = "missing" if saved is None else f"{saved.dtype} {list(saved.shape)}"
            raise CheckpointError(
                f"{path}: cannot be loaded: tensor {name} is {what}, this job's {tensor.dtype} {list(tensor.shape)}"
            )
    return loaded, manifest["progress"]


def read_rank(folder: Path) -> dict[str, torch.Tensor]:
    """One worker's shard as it was saved (names, shapes and dtypes from its manifest), checked."""
    manifest = _manifest(folder)
    template = {}
    for name, saved in manifest.get("layout", {}).items():
        dtype = getattr(torch, str(saved.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{folder / MANIFEST}: tensor {name} has no known dtype ({saved.get('dtype')!r})")
        template[name] = torch.empty(saved["shape"], dtype=dtype)
    return _load_verified(folder, template, manifest)[0]


def check_rank(folder: Path) -> dict[str, Any]:
    """The rank's manifest, once its file is present with its recorded size and a header that lays
    out the manifest's tensors to the file's last byte. What the bytes hold is checked by their
    sha256 as a worker loads them (``load_rank``): one pass over them, in every worker at once,
    before its first step, so a corrupt shard still ends the job in one line and changes nothing."""
    manifest = _manifest(folder)
    path = folder / STATE
    try:
        with path.open("rb") as file:
            entries = read_layout(file)
            header_end = file.tell()
    except TensorFileError as error:
        raise CheckpointError(f"{path}: corrupt ({error})") from None
    layout = {name: _layout(shape, dtype) for name, dtype, shape, *_ in entries}
    end = header_end + (entries[-1][4] if entries else 0)
    if layout != manifest.get("layout") or end != manifest["files"][STATE]["bytes"]:
        raise _differs(path, folder / MANIFEST)
    return manifest


def _manifest(folder: Path) -> dict[str, Any]:
    """The rank's manifest, once every file it names is present with its recorded size (their sha256
    is taken by ``_load_verified`` as it reads them: one pass over the bytes)."""
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(
            f"{manifest_path}: missing; the checkpoint is partial (interrupted while saving)"
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest_path}: corrupt ({error})") from None
    if not isinstance(files, dict) or STATE not in files:
        raise CheckpointError(
            f"{manifest_path}: names no {STATE}, so it is of an earlier format (torch.distributed.checkpoint "
            "files); resume it with the release that wrote it, or start the job anew"
        )
    for name, record in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the checkpoint")
        if path.stat().st_size != record.get("bytes"):
            raise _differs(path, manifest_path)
    return manifest


def _layout(shape: Any, dtype: torch.dtype) -> dict[str, Any]:
    """A tensor's entry in the manifest's layout, as ``save_rank`` writes it and ``check_rank`` compares it."""
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}


def _differs(path: Path, manifest_path: Path) -> CheckpointError:
    return CheckpointError(f"{path}: corrupt (its size or sha256 differs from {manifest_path})")


def complete_info(group_folder: Path) -> dict[str, Any] | None:
    """The group's ``complete.json``, or None while the group's checkpoint is partial."""
    try:
        return json.loads((group_folder / COMPLETE).read_text())
    except (OSError, ValueError):  # missing, or group_folder is no folder at all
        return None


def resolve_resume(spec: str, run_dir: Path, search_dir: Path, groups: int) -> dict[int, Path] | None:
    """Each group's checkpoint folder for ``trainer.resume=spec``, or None: start fresh.

    ``spec`` is a checkpoint (``…/checkpoints/step-N``), a run directory (each group's newest
    whole checkpoint in it), ``latest`` (the run under ``search_dir`` whose newest whole
    checkpoint is the newest of all, this run excluded), or ``auto`` (as ``latest`` where there is
    such a run, else None: one command line both starts a job and resumes it). Every group needs
    one: a job resumes with the state of each of its groups, or not at all.
    """
    source = resume_source(spec, run_dir, search_dir)
    if source is None:
        return None
    if (source / CHECKPOINTS).is_dir():
        return {g: _newest_of_group(source / CHECKPOINTS, g) for g in range(groups)}
    found = {}
    for g in range(groups):
        folder = group_dir(source, g)
        if complete_info(folder) is None:
            raise CheckpointError(
                f"trainer.resume={spec}: {folder / COMPLETE} is missing: group {g}'s checkpoint is partial "
                "or absent (a checkpoint is a run's checkpoints/step-N folder)"
            )
        found[g] = folder
    return found


def resume_source(spec: str, run_dir: Path, search_dir: Path) -> Path | None:
    """The run directory or checkpoint ``trainer.resume=spec`` names (``latest`` and ``auto``
    looked up under ``search_dir``), or None where ``auto`` finds no whole checkpoint."""
    if spec in (LATEST, AUTO):
        # auto continues a job that stopped (planned stop, failure); a finished one has nothing left to train
        source = _newest_run(search_dir, exclude=run_dir, finished_too=spec == LATEST)
        if source is None and spec == LATEST:
            raise CheckpointError(
                f"trainer.resume=latest: no run under {search_dir} (trainer.checkpoint.search_dir) has a whole "
                "checkpoint; name a run directory or a checkpoint instead, or trainer.resume=auto to start fresh "
                "when none has"
            )
        return source
    source = Path(spec)
    _refuse_part_of_a_checkpoint(spec, source)
    if not source.is_dir():
        raise CheckpointError(
            f"trainer.resume={spec}: no such directory; pass a checkpoint folder (RUN/checkpoints/step-N), "
            "a run directory, latest or auto"
        )
    return source


def enclosing_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder (``RUN/checkpoints/step-N``) that is or holds ``path``, or None."""
    return next((p for p in (path, *path.parents) if p.parent.name == CHECKPOINTS and p.name.startswith("step-")), None)


def _refuse_part_of_a_checkpoint(spec: str, source: Path) -> None:
    """A file (a worker's ``state.safetensors``, its manifest) or a group's or worker's folder is a part of a checkpoint:
    name the checkpoint folder it belongs to, which is what ``trainer.resume`` takes."""
    enclosing = enclosing_checkpoint(source)
    if not source.exists() or (source.is_dir() and enclosing in (None, source)):
        return  # nothing there, a checkpoint or another folder: resolve_resume says which
    what = "a folder inside" if source.is_dir() else "a file of"
    if enclosing is None:
        raise CheckpointError(
            f"trainer.resume={spec}: a file, not a checkpoint; a checkpoint is a folder (RUN/checkpoints/step-N): "
            "pass one, a run directory, latest or auto"
        )
    raise CheckpointError(
        f"trainer.resume={spec}: {what} the checkpoint {enclosing}; a checkpoint is a folder, so pass "
        f"trainer.resume={enclosing}"
    )


def _newest_of_group(checkpoints: Path, group: int) -> Path:
    whole = [f for f in sorted(checkpoints.glob(f"step-*/group-{group}")) if complete_info(f) is not None]
    if not whole:
        raise CheckpointError(f"{checkpoints}: no whole checkpoint of group {group}")
    return whole[-1]


def whole_group_checkpoints(root: Path) -> list[Path]:
    """The ``complete.json`` of every whole group checkpoint under ``root`` (a run dir, or a tree of them)."""
    return sorted(root.glob(f"**/{CHECKPOINTS}/step-*/group-*/{COMPLETE}"))


def _newest_run(search_dir: Path, exclude: Path, finished_too: bool) -> Path | None:
    newest: tuple[float, Path] | None = None
    done = set() if finished_too else carried_to_the_end(search_dir)
    for marker in whole_group_checkpoints(search_dir):
        run = marker.parents[3]
        if run.resolve() == exclude.resolve() or (not finished_too and (finished(run) or run.resolve() in done)):
            continue
        written = marker.stat().st_mtime
        if newest is None or written > newest[0]:
            newest = (written, run)
    return None if newest is None else newest[1]


def carried_to_the_end(search_dir: Path) -> set[Path]:
    """The runs under ``search_dir`` a finished run continued, directly or through other resumed runs.

    A stopped run A resumed by a job B that then finished has nothing left to train either: B's
    ``job.json`` names A (``trainer.resume``, pinned by the launcher), so ``auto`` skips A too.
    """
    carried: set[Path] = set()
    for run in (summary.parent for summary in search_dir.glob("**/summary.json")):
        if not finished(run):
            continue
        seen = {run.resolve()}
        while (source := _resumed_from(run)) is not None and source not in seen:  # a loop of links ends
            carried.add(source)
            seen.add(source)
            run = source
    return carried


def _resumed_from(run: Path) -> Path | None:
    """The run directory ``run``'s job resumed from (its pinned ``trainer.resume``), or None."""
    try:
        spec = json.loads(RunPaths(run).job.read_text())["trainer"]["resume"]
    except (OSError, ValueError, KeyError, TypeError):  # no job.json (a worker never started), or a foreign one
        return None
    if not spec:
        return None
    source = Path(spec)
    checkpoint = enclosing_checkpoint(source)
    return (source if checkpoint is None else checkpoint.parents[1]).resolve()


def finished(run: Path) -> bool:
    """Whether ``run`` ended with its final model (summary.json says ok): no step of it is left to train."""
    try:
        return json.loads(RunPaths(run).summary.read_text()).get("ok") is True
    except (OSError, ValueError, AttributeError):  # no summary (stopped, running, killed) or an unreadable one
        return False


def describe_resume(spec: str, folders: dict[int, Path] | None, search_dir: Path) -> str:
    """One line for the start of a job: where each group resumes from (its folder, inner step and
    committed round), or that ``auto`` found nothing to resume."""
    if folders is None:
        return (
            f"starting fresh: trainer.resume={spec} found no whole checkpoint of an unfinished run under "
            f"{search_dir} (trainer.checkpoint.search_dir)"
        )
    parts = []
    for group, folder in sorted(folders.items()):
        info = complete_info(folder) or {}
        parts.append(f"group {group} from {folder} (step {info.get('step')}, round {info.get('committed')})")
    how = f" (trainer.resume={spec})" if spec in (LATEST, AUTO) else ""  # a path given is in the folders named
    return f"resuming{how}: " + "; ".join(parts)


def check_compatible(group_folder: Path, expected: dict[str, Any]) -> None:
    """Refuse a checkpoint written by a job of another shape (model, groups, workers, algorithm, optimizers).

    A key a checkpoint from before it was recorded lacks is not compared: loading checks its
    tensors' names and shapes against the job's all the same (``load_rank``), only later.
    """
    info = complete_info(group_folder) or dict.fromkeys(expected)  # none at all: every key differs
    for key, value in expected.items():
        value = json.loads(json.dumps(value))  # as complete.json holds it: tuples are lists there
        if key in info and info[key] != value:
            raise CheckpointError(
                f"{group_folder / COMPLETE}: written with {_differences(key, info[key], value)}; "
                "resume with the configuration the checkpoint was written with"
            )


def _differences(key: str, saved: Any, wanted: Any) -> str:
    """``key=saved, this job has wanted``; for a section (``model``) each key of it that differs."""
    if not (isinstance(saved, dict) and isinstance(wanted, dict)):
        return f"{key}={saved!r}, this job has {wanted!r}"
    names = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
    return "; ".join(f"{key}.{k}={saved.get(k)!r}, this job has {wanted.get(k)!r}" for k in names)
