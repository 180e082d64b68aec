"""Where a group's metrics go: a JSON-lines file in the run directory, and wandb.

The JSON-lines file is the launcher's view of progress (it draws the console bar from it)
and a record anyone can plot without wandb; wandb is the dashboard users know.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from diloco.config.logger import LoggerConfig


class MetricsLogger:
    """Appends ``{"step": s, "time": t, **metrics}`` lines to a file and mirrors them to wandb."""

    def __init__(self, jsonl_path: Path, wandb_run: Any | None) -> None:
        jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = jsonl_path.open("a", buffering=1)
        self._wandb_run = wandb_run

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, "time": time.time(), **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=step)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self._file.close()
        if self._wandb_run is not None:
            if summary:
                self._wandb_run.summary.update(summary)
            self._wandb_run.finish()


def start_wandb(cfg: LoggerConfig, *, run_dir: Path, member: str, job_name: str, config: dict[str, Any]) -> Any | None:
    """Start the wandb run of ``member`` (``group1``; a warm spare's ``spare3`` until it takes a group),
    grouped by job or sweep, or ``None`` when logging is disabled."""
    if cfg.mode == "disabled":
        return None
    import wandb  # heavy import: only the processes that log pay for it

    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=_run_name(cfg, job_name, member),
        group=cfg.group or job_name,
        mode=cfg.mode,
        dir=str(run_dir),
        config=config,
        settings=wandb.Settings(console="off", silent=True),
    )


def rename_wandb_run(run: Any, cfg: LoggerConfig, *, member: str, job_name: str, config: dict[str, Any]) -> None:
    """A warm spare's run, started while it was built, becomes the run of the group it took over."""
    run.name = _run_name(cfg, job_name, member)
    run.config.update(config, allow_val_change=True)


def _run_name(cfg: LoggerConfig, job_name: str, member: str) -> str:
    return f"{cfg.name or job_name}-{member}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines file ([] if there is none yet); a line a live process
    is still writing is left out."""
    return read_jsonl_tail(path, 0)[0]


def perplexity(loss: float) -> float:
    """exp(loss), clamped: math.exp raises past ~709, and a diverged run must still report its numbers."""
    return math.exp(min(loss, 50.0))


def read_jsonl_tail(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete records appended to ``path`` since byte ``offset``, and the new offset."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return [], offset
    complete = chunk[: chunk.rfind(b"\n") + 1]
    records = [json.loads(line) for line in complete.splitlines() if line.strip()]
    return records, offset + len(complete)


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN: a non-finite metric is written as null so the file stays parseable."""
    value = float(value)
    return value if math.isfinite(value) else None
