"""Hydra entry point: ``python run.py [key=value ...]``, ``python run.py -m key=a,b`` for sweeps.

The composed config becomes a typed, validated ``JobConfig`` here, once; nothing below this
file sees hydra. Invalid values stop the run before any process starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from diloco.config import job_config_from_dict
from diloco.config_base import ConfigError
from diloco.data import DataError
from diloco.distributed import WorkerEnv
from diloco.ft.lighthouse import serve_forever
from diloco.launcher import JobFailed
from diloco.run_local import launch
from diloco.worker import RunPaths, exit_without_teardown, run_worker


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    raw = OmegaConf.to_container(cfg, resolve=True)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        job = job_config_from_dict(raw)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if job.role == "lighthouse":
            serve_forever(job.cluster.lighthouse, job.cluster.quorum_rules(), job.name)
            return None
        if job.role == "group":
            run_worker(job, WorkerEnv.from_environ(os.environ), RunPaths(run_dir))
            exit_without_teardown()
        summary = launch(job, run_dir)
    except (ConfigError, DataError) as error:
        sys.exit(f"error: {error}")
    except JobFailed as error:
        sys.exit(f"job failed: {error}")
    except KeyboardInterrupt:
        sys.exit("interrupted: all workers stopped")
    print(
        f"done: eval loss {summary['final_eval_loss']:.4f} (ppl {summary['final_eval_ppl']:.2f}), "
        f"{summary['tokens_seen']:,} tokens in {summary['wall_seconds']:.0f}s; summary in {run_dir / 'summary.json'}"
    )
    return summary["final_eval_loss"]  # the objective a hydra sweeper minimises


if __name__ == "__main__":
    main()
