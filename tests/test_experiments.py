"""The benchmark scripts run end to end (``--quick``) and print their tables and target checks.

Timings on a shared CPU are noisy, so PASS is never required of a timing target; the bytes
ratio against DDP is deterministic, so it is checked whenever ``algo=ddp`` exists.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.common import compose_job
from tests.conftest import REPO

TIMEOUT_S = 240


def run_script(name: str, results: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "experiments" / name), "--quick", "--results", str(results)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.parametrize("experiment", ["bench_sync", "bench_overhead"])
def test_experiment_configs_compose(experiment):
    job = compose_job([], experiment)
    assert job.model.n_layers >= 4 and job.trainer.log_every == 1


@pytest.mark.slow
def test_bench_sync_quick(tmp_path):
    out = run_script("bench_sync.py", tmp_path)
    assert "| groups | median outer sync ms | median inner step ms | sync / inner-step ratio |" in out
    assert re.search(r"^\| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.MULTILINE), out
    assert re.search(r"costs <= 2 inner steps: (PASS|FAIL) \(ratio [\d.]+\)", out), out
    assert (tmp_path / "bench_sync.md").read_text().strip() == out.strip()


@pytest.mark.slow
def test_bench_overhead_quick(tmp_path):
    out = run_script("bench_overhead.py", tmp_path)
    assert "| config | syncs committed (all groups) | with syncs s | algo=local s | overhead %" in out
    assert "| config | bytes sent | bytes / token |" in out
    assert re.search(r"adds at most 3% wall time: (PASS|FAIL) \(overhead [-+\d.]+%", out), out
    bytes_line = re.search(r"fewer bytes per token than ddp: (.*)$", out, re.MULTILINE)
    assert bytes_line, out
    if "ddp unavailable" not in bytes_line.group(1):
        ratio = float(re.search(r"\(ratio ([\d.]+)\)", bytes_line.group(1)).group(1))
        assert ratio >= 400, out
    assert (tmp_path / "bench_overhead.md").exists()


@pytest.mark.slow
def test_bench_restart_quick(tmp_path):
    out = run_script("bench_restart.py", tmp_path)
    assert "| spawn | restarts | median s to first commit | max s | median worker CPU s |" in out
    for spawn in ("exec", "fork"):
        row = rf"^\| {spawn} \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d/2 \|$"
        assert re.search(row, out, re.MULTILINE), out
    assert re.search(r"exec / fork: [\d.]+x the seconds to first commit, [\d.]+x the worker CPU", out), out
    assert (tmp_path / "bench_restart.md").read_text().strip() == out.strip()
