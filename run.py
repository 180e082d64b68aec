"""Hydra entry point: ``python run.py [key=value ...]``, ``python run.py -m key=a,b`` for sweeps.

``conf/`` presets are composed onto the dataclass defaults (``diloco.launch.compose``); the job
runs per its role in ``diloco.launch.roles``, which gets plain values from here, nothing of
hydra's. Invalid values stop the run before any process starts. Nothing imports this file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from diloco.exits import exit_without_teardown
from diloco.launch.compose import output_folder_problem, plain_config, store_base_config
from diloco.launch.job_token import token_problem_on_command_line
from diloco.launch.roles import SweepJob, exit_like, run_role


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    sweep = None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep = SweepJob(hydra_cfg.sweep.dir, hydra_cfg.job.num, hydra_cfg.job.override_dirname)
    return run_role(plain_config(cfg), Path(hydra_cfg.runtime.output_dir), sweep, os.environ)


if __name__ == "__main__":
    if problem := token_problem_on_command_line(sys.argv[1:]) or output_folder_problem(sys.argv[1:]):
        exit_without_teardown(1, problem)
    store_base_config()
    try:
        main()
    except SystemExit as stop:
        exit_like(stop)
    exit_like(None)
