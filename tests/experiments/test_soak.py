"""experiments/soak.py: its presets compose, its counting is right on a canned run directory,
and ``--quick`` runs end to end with kills, recoveries, both runs ok and no digest mismatch.

The quick run's loss target is not required to PASS (a minute of a tiny model on a shared
CPU is noisy), nor the 1,200 recoveries (that is the full soak's scale).
"""

from __future__ import annotations

import json
import re

import pytest
from common import compose_job
from fault_tolerance import load_run
from soak import EXPERIMENT, digest_mismatches, numbers, table, targets

from tests.canned_runs import canned_run, commit_record, write_jsonl
from tests.conftest import compose_job as compose_like_run_py
from tests.conftest import run_experiment

TIMEOUT_S = 480
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


@pytest.mark.slow
def test_soak_quick(tmp_path):
    out, err = run_experiment("soak.py", ["--quick", "--results", str(tmp_path)], TIMEOUT_S)
    text = (tmp_path / "soak.md").read_text()
    assert text.strip() == out.strip()
    for label in ROW_LABELS:
        assert re.search(rf"^\| {re.escape(label)} \| .+ \| .+ \|$", text, re.MULTILINE), label
    for target in (">= 1200 recoveries:", "0 digest mismatches", "final eval loss within 3%", "both runs ok:"):
        assert re.search(rf"^{re.escape(target)}.*(PASS|FAIL)", text, re.MULTILINE), target
    assert "plan:" in err and "trainer.max_steps=" in err, err[-2000:]
    figures = json.loads((tmp_path / "soak.json").read_text())
    faulty, clean = figures["faulty"], figures["fault-free"]
    assert faulty["ok"] and clean["ok"], text
    assert faulty["kills"] > 0 and faulty["recoveries"] > 0, text
    assert faulty["digest_mismatches"] == 0 and clean["digest_mismatches"] == 0, text
    assert faulty["rounds_checked"] > 0, text
    assert clean["kills"] == 0, text
