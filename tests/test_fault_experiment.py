"""experiments/fault_tolerance.py runs end to end (``--quick``): kills happen and killed groups come back.

The loss and stall targets are not required to PASS here (a minute of a tiny model on a
shared CPU is noisy). Recovery is: every kill must be followed by a healed restart, except a
kill that lands so close to the end of the job that no peer is left to heal from (the script
counts those as ``late_failures``; with a kill every 10 s at most the last one can be).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_experiment

TIMEOUT_S = 300


@pytest.mark.slow
def test_fault_tolerance_quick(tmp_path):
    # --steps skips the calibration run (soak's smoke covers it): about 17 s per run on these
    # machines, 3 kills each (at 6, 11 and 16 s).
    args = ["--quick", "--steps", "180", "--kill-every", "5", "--results", str(tmp_path)]
    run_experiment("fault_tolerance.py", args, TIMEOUT_S)
    table = (tmp_path / "fault_tolerance.md").read_text()
    assert "| kills injected |" in table and "every killed group recovers:" in table, table
    faulty = json.loads((tmp_path / "fault_tolerance.json").read_text())["faulty"]
    assert faulty["kills"] > 0, table
    assert faulty["late_failures"] <= 1, table
    assert faulty["recoveries"] >= faulty["kills"] - faulty["late_failures"], table
    assert faulty["time_to_heal_s"].get("count", 0) >= faulty["recoveries"], table
    choices = faulty["recovery_choices"]
    # one choice per death that gets a replacement (a kill after the job's end gets none)
    assert choices["wait"] + choices["go_on"] >= faulty["kills"] - faulty["late_failures"], table
    assert choices["actual_cost_s"].get("count", 0) >= 1, table
    spared = json.loads((tmp_path / "fault_tolerance.json").read_text())["faulty, 1 warm spare"]
    assert spared["kills"] > 0 and spared["spare_takeovers"] >= 1, table
    assert spared["recoveries"] >= spared["kills"] - spared["late_failures"], table
    assert spared["death_to_first_commit_s"].get("count", 0) >= 1, table
    assert "| death to first commit s (median / p90 / max) |" in table and "with a warm spare" in table, table

    pytest.importorskip("matplotlib", reason="the script skips the PNG without matplotlib")
    assert (tmp_path / "fault_tolerance.png").stat().st_size > 0
