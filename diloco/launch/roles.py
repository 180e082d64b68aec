"""What ``python run.py`` does with a composed job, per ``role``: launch it here (``local``), serve
its lighthouse, be one worker of a group, summarize a multi-host run, use a trained model, or
tokenize a corpus once for ``data=tokens`` (``prepare``).

``run.py`` hands over plain values only (the composed dict, hydra's output folder, in a ``-m``
sweep which job this is, and the environment a group's worker reads torchrun's ranks from), so
this module needs no hydra and reads no hidden input; the files kept in hydra's formats are
``compose``'s.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from diloco import lifeline
from diloco.config.algo import KEYS_READ as ALGO_KEYS_READ
from diloco.config.base import ConfigError, to_dict
from diloco.config.inner_opt import KEYS_READ as INNER_OPT_KEYS_READ
from diloco.config.job import JobConfig, job_config_from_dict
from diloco.config.redaction import redacted
from diloco.exits import INTERRUPTED_EXIT_CODE, JOB_ENDED_EXIT_CODE, exit_without_teardown
from diloco.files import OutputError, write_json_atomically, write_text_atomically
from diloco.ft.lighthouse import serve_forever
from diloco.ft.manager import GroupRefused, JobEndedError, MembershipError
from diloco.launch.addresses import check_addresses, check_lighthouse_listens
from diloco.launch.compose import SweepJobFailed, load_saved_config, to_yaml, write_sweep_table
from diloco.launch.export import EXPORT_FOLDER, export_checkpoint
from diloco.launch.group_console import GroupConsole, say_done
from diloco.launch.inference import evaluate_checkpoint, locate_weights, sample_text
from diloco.launch.job_token import with_job_token
from diloco.launch.launcher import JobInterrupted, launch, run_dir_claimed
from diloco.launch.local_cluster import JobFailed
from diloco.launch.outcome import group_outcome
from diloco.launch.progress import render_done, say
from diloco.launch.summary import summarize_after_the_end, summarize_finished_run
from diloco.launch.trained_run import RUN_SETTINGS, data_words, overridden_line, override_keys, with_run_settings
from diloco.launch.wandb_key import check_wandb_key
from diloco.prepare.pipeline import prepare_corpus
from diloco.refusal import clear_refusal, refuse_group
from diloco.run_paths import RunPaths
from diloco.train.data import DataError
from diloco.worker.entry import refuse_finished_group, run_worker
from diloco.worker.env import WorkerEnv
from diloco.worker.stopped_guard import start_guard


@dataclass(frozen=True)
class SweepJob:
    """One job of a ``-m`` sweep, as hydra names it: the sweep's folder (as given), the job's
    number and its overrides joined into a folder-like name."""

    dir: str
    num: int
    override_dirname: str


def run_role(
    raw: dict[str, Any],
    output_dir: Path,
    sweep: SweepJob | None,
    environ: Mapping[str, str],
    overrides: Sequence[str] = (),
) -> float | None:
    """Run the job ``raw`` composes in hydra's ``output_dir``; the objective a sweeper minimises
    (the final eval loss) or None. A failure exits 1 with its reason, or in a sweep raises
    ``SweepJobFailed`` so hydra runs the other jobs. ``overrides``: the command line's, as hydra
    got them (``data=text``): a trained model is used with its run's settings but those."""
    paths = RunPaths(output_dir)
    if sweep:
        name_sweep_job(raw, sweep)
    try:
        if sweep:  # algo=ddp,diloco algo.alpha=0.3 (or inner_opt=adamw,muon inner_opt.momentum=0.9): not refused
            for ignored in filter(None, (keys.reset(raw) for keys in (ALGO_KEYS_READ, INNER_OPT_KEYS_READ))):
                say(f"sweep job {sweep.num}: warning: {ignored}", sys.stderr)
        job = with_job_token(job_config_from_dict(raw), environ)  # from token_file or the environment
        if job.role == "lighthouse":
            job.cluster.lighthouse.check_bind()  # refused before anything is written
        env = WorkerEnv.from_environ(environ) if job.role == "group" else None  # torchrun's, before any write
        check_addresses(job)  # every address this role binds or dials, before any process starts
        if job.role in ("local", "group"):
            check_wandb_key(job.logger, environ)
        if job.role == "group":
            clear_refusal(paths, job.group.id)
            refuse_finished_group(paths, job.group.id)
            if paths.summary.exists():  # the job ended; torchrun restarting a group after it gets a quick no
                exit_without_teardown(
                    JOB_ENDED_EXIT_CODE,
                    f"error: the job in hydra.run.dir={paths.root} already ended ({paths.summary} is there): "
                    f"group {job.group.id} came back too late and has nothing to do (for a new job, pick a new "
                    "hydra.run.dir)",
                )
        if job.role not in ("summary", "local"):  # the summary reads a run; the launcher claims its directory first
            write_text_atomically(paths.root / "config.yaml", to_yaml(redacted(as_resolved(raw, job))))
        if job.role == "group":
            if not paths.commits(job.group.id).exists():  # never in this job: an address no one listens on is a typo
                check_lighthouse_listens(job.cluster.lighthouse, job.cluster.timeouts.connect)
            run_group(job, paths, env, environ)
        if job.role in ("eval", "sample", "export"):
            return use_trained_model(job, paths, raw, override_keys(overrides))
        if job.role == "prepare":  # a corpus into tokens: no lighthouse, no groups
            prepare_corpus(job.prepare, lambda line: say(line, sys.stdout))
            return None
        if job.role == "lighthouse":
            try:
                serve_forever(
                    job.cluster.lighthouse, job.cluster.quorum_rules(), job.name, saved_page=paths.status_page
                )
            except OSError as error:  # a port it cannot take after all: the message names the key and the fix
                raise ConfigError(str(error)) from None
            if not paths.all_commits():  # its own run directory, not the one the groups share
                return None
            summary = summarize_after_the_end(job, paths, wait_s=job.cluster.timeouts.end)
        elif job.role == "summary":
            summary = summarize_finished_run(job, paths)
        else:
            with run_dir_claimed(paths):
                write_text_atomically(paths.root / "config.yaml", to_yaml(redacted(as_resolved(raw, job))))
                summary = launch(job, paths.root)
    except (ConfigError, DataError) as error:
        if raw.get("role") == "group":  # torchrun would start it again, to be refused alike
            refuse_group(f"error: {error}", paths, _group_id(raw), environ)
        fail(f"error: {error}", sweep)
    except OutputError as error:
        fail(f"error: {error}", sweep)
    except JobFailed as error:
        fail(f"job failed: {error}", sweep)
    except JobInterrupted as stopped:
        sys.exit(str(stopped))
    except KeyboardInterrupt:
        sys.exit("interrupted: all workers stopped")
    finally:
        if sweep:
            table = write_sweep_table(Path(sweep.dir))
            say(f"sweep job {sweep.num}: its row, with every job's so far, in {table}", sys.stdout)
    for loss in summary.get("state_lost", []):  # the model is still the job's, but steps were trained twice
        say(
            f"warning: every group holding round {loss['lost_round']} (inner step {loss['lost_step']}) died "
            f"before another took its state; the job went on from inner step {loss['went_on_from_step']}, "
            "the best state that survived",
            sys.stdout,
        )
    say(render_done(summary, paths.summary), sys.stdout)
    if not summary["ok"] and job.role != "lighthouse":  # a lighthouse's exit 0 says only that the job ended
        fail(f"job failed: {summary['failure']}", sweep)
    return summary["final_eval_loss"]


def fail(message: str, sweep: SweepJob | None) -> NoReturn:
    """End a failed job: exit 1 with ``message``; in a sweep, say it now and let the sweep go on."""
    if not sweep:
        sys.exit(message)
    say(f"sweep job {sweep.num}: {message}", sys.stderr)
    raise SweepJobFailed(message.splitlines()[0])


def name_sweep_job(raw: dict[str, Any], sweep: SweepJob) -> None:
    """In a ``-m`` sweep, group every job's wandb runs by the sweep and name them by the job's
    overrides (unless ``logger.group`` / ``logger.name`` say otherwise)."""
    logger = raw.setdefault("logger", {})
    logger["group"] = logger.get("group") or f"{raw.get('name', 'diloco')} sweep {sweep.dir}"
    logger["name"] = logger.get("name") or sweep.override_dirname or f"job{sweep.num}"


def use_trained_model(job: JobConfig, paths: RunPaths, raw: dict[str, Any], explicit: frozenset[str]) -> float | None:
    """``role=eval``: the loss of ``checkpoint``'s model on held-out windows (also in eval.json);
    ``role=sample``: text continuing ``sample.prompt``; ``role=export``: a Hugging Face directory
    (``diloco.launch.export``). Each reads its data and windows from the run that trained the
    model, but for those the command line set (``explicit``, of the composed ``raw``): said in a line.

    eval.json goes to this invocation's own directory, never the trained run's: that stays as its
    job left it, and a second eval on other data would overwrite the first's record there."""
    weights, run_dir = locate_weights(job.checkpoint)
    trained = trained_job_config(run_dir, job)
    used, given = with_run_settings(raw, trained, explicit, job.role)
    if line := overridden_line(job.role, used, trained, given):
        say(line, sys.stderr if job.role == "sample" else sys.stdout)  # sample's stdout is its text
    with_tokenizer = dataclasses.replace(trained, data=used.data)  # the model's, found through the data used
    if job.role == "sample":
        print(sample_text(used, weights, with_tokenizer))
        return None
    if job.role == "export":
        say(
            f"exported {weights} to {export_checkpoint(weights, with_tokenizer, paths.root / EXPORT_FOLDER)}",
            sys.stdout,
        )
        return None
    if not (run_dir / "config.yaml").is_file():  # a model.pt alone: every setting was the command line's
        given = list(RUN_SETTINGS[job.role])
    record = evaluate_checkpoint(used, weights, trained) | {"run_dir": str(run_dir), "from_command_line": given}
    write_json_atomically(paths.root / "eval.json", record)
    say(
        f"eval loss {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.2f}) on {record['tokens']:,} held-out "
        f"tokens of {data_words(used.data)}; {weights}; recorded in {paths.root / 'eval.json'}",
        sys.stdout,
    )
    return record["eval_loss"]


def as_resolved(raw: dict[str, Any], job: JobConfig) -> dict[str, Any]:
    """What a run's config.yaml keeps: the composed keys, with the model's shape and the data's
    vocabulary as files decided them (``model.init_from``'s config.json, a corpus's tokens.json),
    so the run's model can be used after those files moved."""
    return raw | {"model": to_dict(job.model), "data": to_dict(job.data)}


def trained_job_config(run_dir: Path, job: JobConfig) -> JobConfig:
    """The job that trained a model (its shape, its algorithm, its data and windows): from the
    config.yaml its run wrote, else the command line's. A checkpoint it started from that is gone
    since is not needed: the saved shape is the one it gave."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return job
    raw = load_saved_config(saved)
    for keys in (ALGO_KEYS_READ, INNER_OPT_KEYS_READ):
        keys.reset(raw)  # a run from before such keys were refused: they did nothing there
    model = raw.get("model") or {}
    if model.get("init_from") and not Path(model["init_from"]).is_dir():
        raw["model"] = model | {"init_from": None}
    return job_config_from_dict(raw)


def run_group(job: JobConfig, paths: RunPaths, env: WorkerEnv, environ: Mapping[str, str]) -> NoReturn:
    """One worker of a multi-host job's group: exits 0 only if the group ends holding the job's final model.

    Under torchrun, which restarts the group when a worker exits, a worker dies with its agent,
    and the leader starts the guard that kills a worker stopped for good (``stopped_guard``); a
    group the lighthouse refuses, or whose data or configuration a worker refuses, is not
    restarted (``diloco.refusal``).
    """
    if env.under_agent:
        lifeline.die_with_parent()
        if env.local_rank == 0:
            start_guard(job.cluster.timeouts.stopped)
    console = GroupConsole(job, paths).start() if env.rank == 0 else None
    try:
        report = run_worker(job, env, paths)
    except (GroupRefused, ConfigError, DataError) as error:
        refuse_group(f"error: {error}", paths, job.group.id, environ)
    except (MembershipError, OutputError) as error:
        too_late = isinstance(error, JobEndedError)  # an orchestrator need not restart it
        exit_without_teardown(JOB_ENDED_EXIT_CODE if too_late else 1, f"error: {error}")
    except Exception as error:
        if (lost := peer_lost(error)) is None:
            raise
        log = paths.worker_log(job.group.id, env.rank)
        keep_traceback(log)
        exit_without_teardown(
            1,
            f"error: group {job.group.id} rank {env.rank}: a worker of its group is gone (its collective failed: "
            f"{lost}); torchrun starts the group again and it heals from a peer; the traceback is in {log}",
        )
    finally:
        if console is not None:
            console.stop()
    if report.get("interrupted"):
        where = paths.interrupted_weights(job.group.id)
        exit_without_teardown(
            INTERRUPTED_EXIT_CODE, f"interrupted (planned stop): round {report.get('rounds')}'s global model in {where}"
        )
    problem = group_outcome(report, job.algo.name)
    if console is not None:
        console.finish(report.get("tokens_per_s", 0.0))
        say_done(report, problem, paths)
    exit_without_teardown(1 if problem else 0, problem and f"job failed: {problem}")


# What a collective of the group's own says when a worker of it died (Gloo's transport, NCCL's).
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def peer_lost(error: BaseException) -> str | None:
    """Which of ``PEER_LOST`` ``error`` says, or None: a bug keeps its traceback on the terminal."""
    if not isinstance(error, RuntimeError):
        return None
    return next((said for said in PEER_LOST if said in str(error)), None)


def keep_traceback(log: Path) -> None:
    """Append the exception being handled to ``log`` (the terminal gets one line instead)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        traceback.print_exc(file=fh)


def _group_id(raw: dict[str, Any]) -> int | None:
    """``group.id`` as composed, where the job's config could not be read whole (None: not an integer)."""
    group = (raw.get("group") or {}).get("id")
    return group if isinstance(group, int) and group >= 0 else None


def exit_like(stop: SystemExit | None) -> NoReturn:
    """Exit as ``stop`` says (None: 0; a message: printed, 1), skipping the half second torch's
    interpreter teardown takes once everything is written."""
    code = None if stop is None else stop.code
    if code is None or isinstance(code, int):
        exit_without_teardown(code or 0)
    exit_without_teardown(1, str(code))
