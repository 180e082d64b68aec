"""Hydra entry point: ``python run.py [key=value ...]``, ``python run.py -m key=a,b`` for sweeps.

``conf/`` presets are composed onto the dataclass defaults (``diloco.launch.compose``); the job
runs per its role in ``diloco.launch.roles``, which gets plain values from here, nothing of
hydra's. Invalid values stop the run before any process starts, and a refused run (or a sample,
whose text goes to stdout) takes back the output folder hydra made for it. Nothing imports this file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from diloco.huge_pages import huge_pages_by_default

huge_pages_by_default()  # before anything imports torch

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from diloco.exits import exit_without_teardown
from diloco.launch.compose import (
    existing_ancestor,
    key_problem_on_command_line,
    output_folder_problem,
    plain_config,
    remove_unused_run_folder,
    store_base_config,
)
from diloco.launch.job_token import token_problem_on_command_line
from diloco.launch.roles import SweepJob, exit_like, run_role


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    sweep = None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep = SweepJob(hydra_cfg.sweep.dir, hydra_cfg.job.num, hydra_cfg.job.override_dirname)
    output_dir = Path(hydra_cfg.runtime.output_dir)
    log = f"{hydra_cfg.job.name}.log"
    try:
        objective = run_role(plain_config(cfg), output_dir, sweep, os.environ, list(hydra_cfg.overrides.task))
    except SystemExit as stop:
        if stop.code not in (None, 0) and not sweep:  # a sweep's sweep.md lists every job's folder
            remove_unused_run_folder(output_dir, FOLDER_BEFORE, hydra_cfg.output_subdir, log)
        raise
    if cfg.role == "sample" and not sweep:  # its text went to stdout: nothing of it to keep
        remove_unused_run_folder(output_dir, FOLDER_BEFORE, hydra_cfg.output_subdir, log, said_too=True)
    return objective


if __name__ == "__main__":
    argv = sys.argv[1:]
    if problem := (
        token_problem_on_command_line(argv) or key_problem_on_command_line(argv) or output_folder_problem(argv)
    ):
        exit_without_teardown(1, problem)
    FOLDER_BEFORE = existing_ancestor(argv)  # what of the output folder's path is not hydra's to make
    store_base_config()
    try:
        main()
    except SystemExit as stop:
        exit_like(stop)
    exit_like(None)
