"""experiments/gpu/gpu_check.py: its table from canned results here; the checks themselves on a GPU."""

from __future__ import annotations

import pytest

from experiments.gpu.gpu_check import report
from tests.conftest import run_experiment


def test_the_table_names_every_check_and_its_verdict_without_the_logs():
    results = {
        "smoke": {"ok": True, "eval_loss": 2.1, "logs": "a long log", "failure": None},
        "speed": {"ok": False, "ratio": 0.9, "failure": None},
    }
    table = report(results, "NVIDIA H100; torch 2.11")
    assert table.splitlines()[0] == "NVIDIA H100; torch 2.11"
    assert "| smoke | PASS |" in table and "| speed | FAIL |" in table
    assert '"ratio": 0.9' in table and "a long log" not in table and "failure" not in table


@pytest.mark.slow
@pytest.mark.gpu
def test_two_groups_on_the_gpu_end_ok_with_equal_digests_and_resume():
    out, _ = run_experiment("experiments.gpu.gpu_check", ["--only", "smoke"], timeout_s=300)
    assert "smoke: PASS" in out
