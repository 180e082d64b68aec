"""experiments/fault_tolerance/soak.py: its presets compose, its counting is right on a canned run directory, and
main() plans, runs and writes its table and targets (the jobs stood in for by canned runs).

No real soak run here: its machinery (run_one, Progress, digest_mismatches on a streaming job
with kills and a hang) runs in test_seed_topology_quick, which also reads its runs back with
soak's figures, table and targets; the calibration is tested in test_fault_experiment.py.
"""

from __future__ import annotations

import json
import re
import sys

from experiments.common import compose_job
from experiments.fault_tolerance import soak
from experiments.fault_tolerance.kill_every import load_run
from experiments.fault_tolerance.soak import EXPERIMENT, digest_mismatches, numbers, table, targets
from tests.canned_runs import canned_run, commit_record, write_jsonl
from tests.conftest import compose_job as compose_like_run_py

ROW_LABELS = [
    "outcome",
    "wall time",
    "kills (SIGKILL)",
    "recoveries (restarted processes healed from a peer)",
    "hangs (SIGSTOP)",
    "NaN updates",
    "lighthouse kills",
    "committed / attempted syncs",
    "digest mismatches (rounds committed by 2+ groups)",
    "final eval loss",
    "goodput ratio faulty / fault-free",
]


def test_soak_presets_compose():
    job = compose_job(["faults=soak"], EXPERIMENT)
    assert (job.algo.name, job.algo.sync_every, job.algo.fragments, job.algo.delay) == ("streaming", 20, 2, 1)
    assert job.algo.quantize == "fp4"
    assert (job.cluster.groups, job.cluster.workers_per_group, job.cluster.min_groups) == (4, 1, 2)
    assert job.faults.kill_every == 1.5 and job.faults.min_alive == 2 and job.faults.stop_after == 0
    # What `python run.py +experiment=soak faults=soak` composes (no benchmark BASE in between).
    assert compose_like_run_py(["+experiment=soak", "faults=soak"]).algo.name == "streaming"


def test_soak_counts_on_acanned_run(tmp_path):
    faulty = canned_run(tmp_path, "faulty", {"kill": 3, "restart": 3, "hang": 1, "nan": 2, "lighthouse_down": 1}, 50)
    write_jsonl(
        faulty / "events.jsonl",
        [
            {"time": 10.0, "kind": "restart", "group": 1},
            {"time": 20.0, "kind": "restart", "group": 1},
            {"time": 30.0, "kind": "restart", "group": 2},
        ],
    )
    write_jsonl(
        faulty / "commits" / "group0.jsonl",
        [commit_record(3, 4.0, 100, "a"), commit_record(4, 8.0, 100, "c"), commit_record(5, 9.0, 100, "e")],
    )
    write_jsonl(
        faulty / "commits" / "group1.jsonl",
        [
            commit_record(3, 5.0, 101, "b", recoveries=1),  # the killed process's: before the restart, not a recovery
            commit_record(3, 11.0, 102, None, committed=False),  # the new process, not yet healed
            commit_record(4, 12.0, 102, "c", healed=True, recoveries=1),  # healed from a peer: restart 1 recovered
            commit_record(6, 21.0, 103, "x"),  # the process of the second restart never healed
        ],
    )
    write_jsonl(  # healed at the job's end, in a closing round that commits nothing: a recovery too
        faulty / "commits" / "group2.jsonl",
        [commit_record(5, 31.0, 104, "e", committed=False, healed=True, closing=True, recoveries=1)],
    )
    canned_run(tmp_path, "fault-free", {}, 100)
    runs = {name: load_run(name, tmp_path / name, 20, start=0.0) for name in ("faulty", "fault-free")}

    # Round 3: two groups, two digests (a mismatch); round 4: two groups, one digest; rounds 5 and 6: one
    # group's committed record each (the closing heal of round 5 is not a committed record).
    assert digest_mismatches(runs["faulty"].commits) == ([3], 2)
    assert digest_mismatches(runs["fault-free"].commits) == ([], 0)
    figures = {name: numbers(run, runs["fault-free"]) for name, run in runs.items()}
    f = figures["faulty"]
    assert (f["kills"], f["restarts"], f["recoveries"], f["hangs"], f["nan_updates"]) == (3, 3, 2, 1, 2)
    assert (f["lighthouse_kills"], f["digest_mismatches"], f["goodput_ratio"]) == (1, 1, 0.5)
    text = table(figures)
    for label in ROW_LABELS:
        assert f"| {label} |" in text, text
    assert "| recoveries (restarted processes healed from a peer) | 2 of 3 | 0 of 0 |" in text, text
    assert "| digest mismatches (rounds committed by 2+ groups) | 1 (of 2) | 0 (of 0) |" in text, text
    lines = targets(figures, quick=False)
    assert lines[0].startswith(">= 1200 recoveries: FAIL (2 healed restarts for 3 kills)"), lines
    assert lines[1].startswith("0 digest mismatches after every committed round: FAIL"), lines
    assert lines[2].startswith("final eval loss within 3% of fault-free: PASS"), lines
    assert lines[3].startswith("both runs ok: PASS"), lines


def _soak_run(name: str, run_dir, *args, **kwargs):
    """soak.run_one's stand-in: a canned 3-group run, 2 kills (1 healed), a hang and a NaN update when faulty."""
    faulty = name == "faulty"
    canned_run(
        run_dir.parent, name, {"kill": 2, "restart": 2, "hang": 1, "nan": 1} if faulty else {}, 80 if faulty else 100
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps(summary | {"parameters": 130_000}))
    write_jsonl(run_dir / "events.jsonl", [{"time": 7.0, "kind": "restart", "group": 1}] if faulty else [])
    for group in range(3):
        healed = {"recoveries": 1} if faulty and group == 1 else {}
        write_jsonl(run_dir / "commits" / f"group{group}.jsonl", [commit_record(2, 8.0, 100 + group, "d", **healed)])
    return load_run(name, run_dir, 20, start=0.0)


def test_soak_main_plans_from_the_calibration_and_writes_its_table_on_canned_runs(tmp_path, monkeypatch, capsys):
    """main() end to end with the jobs stood in for: the plan from the calibrated rate, each run's overrides,
    the table, the targets and soak.json. The real machinery (calibration aside: test_fault_experiment.py)
    runs in test_seed_topology_quick, whose runs are read back with soak's figures there."""
    calls = []

    def run_one(name, overrides, run_dir, experiment, keep_failure):
        calls.append((name, overrides, experiment, keep_failure))
        return _soak_run(name, run_dir)

    monkeypatch.setattr("experiments.fault_tolerance.soak.calibrate", lambda root, window_s, experiment, extra: 10.0)
    monkeypatch.setattr("experiments.fault_tolerance.soak.run_one", run_one)
    monkeypatch.setattr("experiments.fault_tolerance.soak.pyplot", lambda: None)
    monkeypatch.setattr("experiments.fault_tolerance.soak.stop_on_sigterm", lambda: None)
    monkeypatch.setattr(sys, "argv", ["soak.py", "--quick", "--results", str(tmp_path)])
    soak.main()
    out, err = capsys.readouterr()
    assert "plan: 10.0 steps/s" in err and "trainer.max_steps=120" in err, err  # 10 steps/s x 0.9 x 12 s
    assert [(name, experiment, keep) for name, _, experiment, keep in calls] == [
        ("faulty", EXPERIMENT, True),
        ("fault-free", EXPERIMENT, True),
    ]
    faulty_overrides, clean_overrides = calls[0][1], calls[1][1]
    assert faulty_overrides[0] == "faults=soak" and "faults.kill_every=3.0" in faulty_overrides
    assert clean_overrides[0] == "faults=none"
    for overrides in (faulty_overrides, clean_overrides):
        assert {"trainer.max_steps=120", "cluster.groups=3"} <= set(overrides), overrides
    text = (tmp_path / "soak.md").read_text()
    assert text.strip() == out.strip()
    for label in ROW_LABELS:
        assert re.search(rf"^\| {re.escape(label)} \| .+ \| .+ \|$", text, re.MULTILINE), label
    assert "| recoveries (restarted processes healed from a peer) | 1 of 2 | 0 of 0 |" in text, text
    for target in (">= 1200 recoveries:", "0 digest mismatches", "final eval loss within 3%", "both runs ok:"):
        assert re.search(rf"^{re.escape(target)}.*(PASS|FAIL)", text, re.MULTILINE), target
    assert ">= 1200 recoveries: FAIL (1 healed restarts for 2 kills) (--quick: not expected)" in text, text
    figures = json.loads((tmp_path / "soak.json").read_text())
    assert figures["faulty"]["kills"] == 2 and figures["faulty"]["digest_mismatches"] == 0
    assert figures["faulty"]["rounds_checked"] == 1 and figures["fault-free"]["ok"]
