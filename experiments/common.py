"""Helpers shared by the benchmark scripts: compose the real conf/ tree, run jobs, read their records.

The scripts use the library one way (docs/design.md, code style 7): a job is composed from ``conf/`` with
hydra exactly as ``python run.py`` would compose it, turned into a ``JobConfig`` once, and
run through ``diloco.launch.local_cluster`` (``launch`` for a whole job, ``LocalCluster`` to kill and
restart groups). Nothing here forks the training code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from diloco.config.job import JobConfig, job_config_from_dict
from diloco.launch.compose import CONF_DIR, compose_raw
from diloco.launch.launcher import launch
from diloco.launch.local_cluster import JobFailed, LocalCluster, logs_tail
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from diloco.worker.builders import preflight

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "experiments" / "results"

# Every benchmark: CPU, one process per group, no wandb, no evaluation on the way.
BASE = [
    "logger=none",
    "cluster.device=cpu",
    "cluster.workers_per_group=1",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
]


def compose_job(overrides: list[str], experiment: str | None = None) -> JobConfig:
    """Compose BASE, then ``conf/experiment/<experiment>.yaml`` if named, then ``overrides``."""
    extra = []
    if experiment is not None:
        # ``+`` appends the group; if config.yaml one day lists ``experiment`` in its defaults,
        # the plain form is the one hydra accepts.
        extra = [f"{'' if _experiment_in_defaults() else '+'}experiment={experiment}"]
    return job_config_from_dict(compose_raw(extra + base_overrides(experiment) + list(overrides)))


def base_overrides(experiment: str | None) -> list[str]:
    """BASE without the values the experiment's preset sets: hydra applies command-line
    overrides after every preset, so a BASE value would otherwise beat the preset's own."""
    if experiment is None:
        return list(BASE)
    preset = yaml.safe_load((CONF_DIR / "experiment" / f"{experiment}.yaml").read_text()) or {}
    return [o for o in BASE if o.split("=", 1)[0] not in _dotted_keys(preset)]


def _dotted_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        if key == "defaults":
            continue  # group choices: a BASE group choice (logger=none) still lets the preset's values merge on top
        keys |= _dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def _experiment_in_defaults() -> bool:
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text()).get("defaults") or []
    keys = [entry if isinstance(entry, str) else " ".join(entry) for entry in defaults]
    return any(key.split()[-1].split("/")[-1].startswith("experiment") for key in keys)


def run_job(
    job: JobConfig, run_dir: Path, keep_failure: bool = False, worker_prefix: dict[int, list[str]] | None = None
) -> dict[str, Any]:
    """Run a whole job quietly (its progress view goes to a buffer); returns summary.json's dict.
    ``worker_prefix``: per group, a command its workers run under (``netns_link``: its own network namespace).

    A job the supervisor gave up on raises ``JobFailed``; with ``keep_failure`` its summary
    (written before the raise: ``ok`` false, ``failure`` the reason) is returned instead.
    """
    try:
        summary = launch(job, run_dir, out=io.StringIO(), worker_prefix=worker_prefix)
    except JobFailed:
        if not keep_failure:
            raise
        summary = json.loads(RunPaths(run_dir).summary.read_text())
    if not summary["ok"]:
        print(failure_report(RunPaths(run_dir)), file=sys.stderr)
    return summary


def failure_report(paths: RunPaths, lines: int = 12) -> str:
    """What a failed job's directory says, for a log that outlives it (CI): its last events and log lines."""
    events = "\n".join(json.dumps(e) for e in read_jsonl(paths.events)[-lines:])
    return f"failed job in {paths.root}; last events:\n{events}\n{logs_tail(paths.logs, lines)}"


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--results DIR`` and ``--keep-runs DIR``: where a script's table goes and whether its runs stay."""
    parser.add_argument("--results", metavar="DIR", help="folder of the results (default experiments/results)")
    parser.add_argument("--keep-runs", metavar="DIR", help="keep the run directories under DIR (default: a temp dir)")


def add_steps_argument(parser: argparse.ArgumentParser) -> None:
    """``--steps N``: the inner steps of every run, instead of the script's calibration."""
    parser.add_argument("--steps", type=int, help="inner steps per run, a multiple of H (default: from a calibration)")


def check_steps(steps: int | None, h: int) -> None:
    """Exit naming the fix unless ``--steps`` is a positive multiple of H (the last round reaches θ_g)."""
    if steps is not None and (steps < h or steps % h):
        sys.exit(
            f"--steps={steps}: must be a positive multiple of H=algo.sync_every={h}; e.g. {max(h, steps // h * h)}"
        )


def stop_on_sigterm() -> None:
    """SIGTERM (a test's timeout, a scheduler) unwinds like Ctrl-C: the with-blocks stop every process of the job."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def runs_root(keep: str | None, name: str) -> Iterator[Path]:
    """Where run directories go: ``keep`` if given (left in place), else a temporary directory."""
    if keep:
        root = Path(keep) / name
        root.mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root))
        return
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        yield Path(tmp)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def write_result(name: str, text: str, folder: str | None = None) -> Path:
    """Write a results table to ``folder`` (default experiments/results, git-ignored); returns its path."""
    root = Path(folder) if folder else RESULTS
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


NO_MATPLOTLIB = "PNG skipped: matplotlib is not installed (pip install -e .[experiments])"


def pyplot() -> Any | None:
    """matplotlib.pyplot drawing to files (the Agg backend), or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Path) -> str:
    """Write ``fig`` as a PNG at ``path``, free it, and say where it went."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


class ClusterRun:
    """A job's processes under a ``LocalCluster`` (``cluster.wait_for`` polls it); stop() leaves nothing behind."""

    def __init__(self, job: JobConfig, run_dir: Path) -> None:
        self.job = job
        self.paths = RunPaths(run_dir)
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self.n_params, signature = preflight(job, self.paths)
        self.cluster = LocalCluster(job, self.paths, signature)

    def __enter__(self) -> ClusterRun:
        self.cluster.start_lighthouse()
        for group in range(self.job.cluster.groups):
            self.cluster.start_group(group)
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop()

    def commits(self, group: int) -> list[dict[str, Any]]:
        return read_jsonl(self.paths.commits(group))

    def metrics(self, group: int) -> list[dict[str, Any]]:
        return read_jsonl(self.paths.metrics(group))

    def committed_by(self, group: int, n_participants: int, after: int = 0) -> list[dict[str, Any]]:
        """The group's committed records among its log lines after the first ``after``, with exactly n participants."""
        return [r for r in self.commits(group)[after:] if r["committed"] and len(r["participants"]) == n_participants]
