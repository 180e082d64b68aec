"""A job's final model.pt, and two of them compared within a tolerance: how the intra-group layout
tests (tensor and pipeline parallelism) hold a layout to the plain run."""

from __future__ import annotations

from pathlib import Path

import torch

from diloco.config.job import JobConfig
from diloco.launch.launcher import launch


def trained(job: JobConfig, run_dir: Path) -> dict[str, torch.Tensor]:
    summary = launch(job, run_dir)
    assert summary["ok"], summary["failure"]
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < tolerance, f"weights differ by {worst}"
