"""A job's final model.pt and its rounds' ‖Δ̄‖, and two of them compared within a tolerance: how
the intra-group layout tests (tensor and pipeline parallelism) hold a layout to the plain run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.config.job import JobConfig
from diloco.launch.launcher import launch
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl


def trained(job: JobConfig, run_dir: Path) -> dict[str, torch.Tensor]:
    summary = launch(job, run_dir)
    assert summary["ok"], summary["failure"]
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < tolerance, f"weights differ by {worst}"


def pseudo_grad_norms(run_dir: Path) -> dict[int, float]:
    """Group 0's ``outer/pseudo_grad_norm`` by inner step: ‖Δ̄‖ of each committed round over the
    whole group, which every layout of the same model and batches must log alike."""
    records = read_jsonl(RunPaths(run_dir).metrics(0))
    return {r["step"]: r["outer/pseudo_grad_norm"] for r in records if "outer/pseudo_grad_norm" in r}


def assert_same_norms(run_dir: Path, reference: Path) -> None:
    norms, expected = pseudo_grad_norms(run_dir), pseudo_grad_norms(reference)
    assert norms.keys() == expected.keys() and norms, (norms, expected)
    assert [norms[s] for s in norms] == pytest.approx([expected[s] for s in norms], rel=1e-5)
