"""Hydra entry point: ``python run.py [key=value ...]``, ``python run.py -m key=a,b`` for sweeps.

``conf/`` presets are composed onto the dataclass defaults (``base_config``); the result
becomes a typed, validated ``JobConfig`` here, once; nothing below this file sees hydra.
Invalid values stop the run before any process starts.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from diloco.config.base import ConfigError, to_dict
from diloco.config.job import JobConfig, job_config_from_dict
from diloco.exits import INTERRUPTED_EXIT_CODE, JOB_ENDED_EXIT_CODE, exit_without_teardown
from diloco.files import OutputError, write_atomically, write_json_atomically
from diloco.ft.lighthouse import serve_forever
from diloco.ft.manager import JobEndedError, MembershipError
from diloco.launch.launcher import JobInterrupted, launch, run_dir_claimed
from diloco.launch.local_cluster import JobFailed
from diloco.launch.outcome import group_outcome
from diloco.launch.progress import say
from diloco.launch.summary import summarize_after_the_end, summarize_finished_run
from diloco.run_paths import RunPaths
from diloco.train.data import DataError
from diloco.launch.inference import evaluate_checkpoint, locate_weights, sample_text
from diloco.worker.entry import refuse_finished_group, run_worker
from diloco.worker.env import WorkerEnv

BASE_CONFIG = "base_config"
CONF_DIR = Path(__file__).resolve().parent / "conf"

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


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    raw = OmegaConf.to_container(cfg, resolve=True)
    paths = RunPaths(Path(HydraConfig.get().runtime.output_dir))
    sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    if sweep:
        name_sweep_job(raw)
    try:
        job = job_config_from_dict(raw)
        if job.role == "group":
            refuse_finished_group(paths, job.group.id)
        if job.role not in ("summary", "local"):  # the summary reads a run; the launcher claims its directory first
            (paths.root / "config.yaml").write_text(OmegaConf.to_yaml(raw))
        if job.role == "group":
            run_group(job, paths)
        if job.role in ("eval", "sample"):
            return use_trained_model(job, paths)
        if job.role == "lighthouse":
            serve_forever(job.cluster.lighthouse, job.cluster.quorum_rules(), job.name)
            if not paths.all_commits():  # its own run directory, not the one the groups share
                return None
            summary = summarize_after_the_end(job, paths, wait_s=job.cluster.timeouts.end)
        elif job.role == "summary":
            summary = summarize_finished_run(job, paths)
        else:
            with run_dir_claimed(paths):
                (paths.root / "config.yaml").write_text(OmegaConf.to_yaml(raw))
                summary = launch(job, paths.root)
    except (ConfigError, DataError, OutputError) as error:
        fail(f"error: {error}", sweep)
    except JobFailed as error:
        fail(f"job failed: {error}", sweep)
    except JobInterrupted as stopped:
        sys.exit(str(stopped))
    except KeyboardInterrupt:
        sys.exit("interrupted: all workers stopped")
    finally:
        if sweep:
            write_sweep_table(Path(HydraConfig.get().sweep.dir))
    for loss in summary.get("state_lost", []):  # the model is still the job's, but steps were trained twice
        say(
            f"warning: every group holding round {loss['lost_round']} (inner step {loss['lost_step']}) died "
            f"before another took its state; the job went on from inner step {loss['went_on_from_step']}, "
            "the best state that survived",
            sys.stdout,
        )
    say(
        f"{'done' if summary['ok'] else 'failed'}: eval loss {summary['final_eval_loss']:.4f} "
        f"(ppl {summary['final_eval_ppl']:.2f}), {summary['tokens_seen']:,} tokens in {summary['wall_seconds']:.0f}s; "
        f"summary in {paths.summary}",
        sys.stdout,
    )
    if not summary["ok"] and job.role != "lighthouse":  # a lighthouse's exit 0 says only that the job ended
        fail(f"job failed: {summary['failure']}", sweep)
    return summary["final_eval_loss"]  # the objective a hydra sweeper minimises


class SweepJobFailed(CompactHydraException):
    """A job of a ``-m`` sweep failed: hydra runs the others, then exits 1 with the first one's
    reason (hydra prints a CompactHydraException as its message alone)."""


def fail(message: str, sweep: bool) -> NoReturn:
    """End a failed job: exit 1 with ``message``; in a sweep, say it now and let the sweep go on."""
    if not sweep:
        sys.exit(message)
    say(f"sweep job {HydraConfig.get().job.num}: {message}", sys.stderr)
    raise SweepJobFailed(message.splitlines()[0])


def name_sweep_job(raw: dict[str, Any]) -> None:
    """In a ``-m`` sweep, group every job's wandb runs by the sweep and name them by the job's
    overrides (unless ``logger.group`` / ``logger.name`` say otherwise)."""
    hydra_cfg = HydraConfig.get()
    logger = raw.setdefault("logger", {})
    logger["group"] = logger.get("group") or f"{raw.get('name', 'diloco')} sweep {hydra_cfg.sweep.dir}"
    logger["name"] = logger.get("name") or hydra_cfg.job.override_dirname or f"job{hydra_cfg.job.num}"


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


def use_trained_model(job: JobConfig, paths: RunPaths) -> float | None:
    """``role=eval``: the loss of ``checkpoint``'s model on the data options' held-out windows
    (also in eval.json); ``role=sample``: text continuing ``sample.prompt``."""
    weights, run_dir = locate_weights(job.checkpoint)
    trained = trained_job_config(run_dir, job)
    if job.role == "sample":
        print(sample_text(job, weights, trained))
        return None
    record = evaluate_checkpoint(job, weights, trained)
    write_json_atomically(paths.root / "eval.json", record)
    say(
        f"eval loss {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.2f}) on {record['tokens']:,} held-out "
        f"tokens of {job.data.corpus}; {weights}",
        sys.stdout,
    )
    return record["eval_loss"]


def trained_job_config(run_dir: Path, job: JobConfig) -> JobConfig:
    """The job that trained a model (its shape, its algorithm): from the config.yaml its run
    wrote, else the command line's."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return job
    return job_config_from_dict(OmegaConf.to_container(OmegaConf.load(saved), resolve=True))


def run_group(job: JobConfig, paths: RunPaths) -> NoReturn:
    """One worker of a multi-host job's group: exits 0 only if the group ends holding the job's final model."""
    try:
        report = run_worker(job, WorkerEnv.from_environ(os.environ), paths)
    except (MembershipError, OutputError) as error:
        too_late = isinstance(error, JobEndedError)  # an orchestrator need not restart it
        exit_without_teardown(JOB_ENDED_EXIT_CODE if too_late else 1, f"error: {error}")
    if report.get("interrupted"):
        where = paths.interrupted_weights(job.group.id)
        exit_without_teardown(
            INTERRUPTED_EXIT_CODE, f"interrupted (planned stop): round {report.get('rounds')}'s global model in {where}"
        )
    problem = group_outcome(report, job.algo.name)
    exit_without_teardown(1 if problem else 0, problem and f"job failed: {problem}")


def output_folder_problem(argv: list[str]) -> str | None:
    """Why hydra could not make the job's output folder, if a file stands in its path: hydra makes
    it before ``main`` runs and would stop with its own traceback."""
    mode = "sweep" if {"-m", "--multirun"} & set(argv) else "run"
    key = f"hydra.{mode}.dir"
    given = [arg.split("=", 1)[1] for arg in argv if arg.lstrip("+").startswith(f"{key}=")]
    default = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))["hydra"][mode]["dir"]
    folder = given[-1] if given else default
    known = folder.split("${", 1)[0]  # what is fixed before hydra resolves the rest
    if "${" in folder:
        known = known.rsplit("/", 1)[0] if "/" in known else ""
    existing = next(part for part in (Path(known), *Path(known).parents) if part.exists())
    if existing.is_dir():
        return None
    return f"error: {key}={folder}: {existing} is a file, not a folder; pick another {key}"


def exit_like(stop: SystemExit | None) -> NoReturn:
    """Exit as ``stop`` says (None: 0; a message: printed, 1), skipping the half second torch's
    interpreter teardown takes once everything is written."""
    code = None if stop is None else stop.code
    if code is None or isinstance(code, int):
        exit_without_teardown(code or 0)
    exit_without_teardown(1, str(code))


if __name__ == "__main__":
    if problem := output_folder_problem(sys.argv[1:]):
        exit_without_teardown(1, problem)
    store_base_config()
    try:
        main()
    except SystemExit as stop:
        exit_like(stop)
    exit_like(None)
