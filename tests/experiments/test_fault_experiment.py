"""experiments/fault_tolerance.py runs end to end (``--quick``): kills happen and killed groups come back.

The loss and stall targets are not required to PASS here (a minute of a tiny model on a
shared CPU is noisy). Recovery is: every kill must be followed by a healed restart, except a
kill that lands so close to the end of the job that no peer is left to heal from (the script
counts those as ``late_failures``; with a kill every 10 s at most the last one can be), or one
before the job's first commit on a loaded machine, with no state to heal from (``early_failures``).
"""

from __future__ import annotations

import json

import pytest
from fault_tolerance import load_run

from tests.canned_runs import canned_run, commit_record, write_jsonl
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
    assert faulty["late_failures"] <= 1 and faulty["early_failures"] <= 2, table
    unrecoverable = faulty["late_failures"] + faulty["early_failures"]
    assert faulty["recoveries"] >= faulty["kills"] - unrecoverable, table
    assert faulty["time_to_heal_s"].get("count", 0) >= faulty["recoveries"], table
    choices = faulty["recovery_choices"]
    # one choice per death that gets a replacement (a kill after the job's end gets none)
    assert choices["wait"] + choices["go_on"] >= faulty["kills"] - faulty["late_failures"], table
    assert choices["actual_cost_s"].get("count", 0) >= 1, table
    spared = json.loads((tmp_path / "fault_tolerance.json").read_text())["faulty, 1 warm spare"]
    assert spared["kills"] > 0 and spared["spare_takeovers"] >= 1, table
    assert spared["recoveries"] >= spared["kills"] - spared["late_failures"] - spared["early_failures"], table
    assert spared["death_to_first_commit_s"].get("count", 0) >= 1, table
    assert "| death to first commit s (median / p90 / max) |" in table and "with a warm spare" in table, table

    pytest.importorskip("matplotlib", reason="the script skips the PNG without matplotlib")
    assert (tmp_path / "fault_tolerance.png").stat().st_size > 0


def test_a_kill_before_the_jobs_first_commit_is_early_and_one_after_it_is_unrecovered(tmp_path):
    run_dir = canned_run(tmp_path, "faulty", {"kill": 2, "restart": 2}, 50)
    write_jsonl(
        run_dir / "events.jsonl",
        [
            {"time": 2.0, "kind": "kill", "group": 1},
            {"time": 3.0, "kind": "restart", "group": 1},
            {"time": 6.0, "kind": "kill", "group": 2},
            {"time": 7.0, "kind": "restart", "group": 2},
        ],
    )
    write_jsonl(run_dir / "commits" / "group0.jsonl", [commit_record(1, 4.0, 100, "a")])  # the job's first commit
    write_jsonl(run_dir / "commits" / "group1.jsonl", [commit_record(1, 4.1, 101, "a")])  # from the initial state
    run = load_run("faulty", run_dir, 20, start=0.0)
    assert [(r.group, r.failed_at) for r in run.recoveries() if r.healed_at is None] == [(1, 2.0), (2, 6.0)]
    assert [(r.group, r.failed_at) for r in run.early_failures()] == [(1, 2.0)]
