"""experiments/scale/seed_topology.py: its presets compose at 30 groups, its figures (efficiencies,
hang stalls, digest mismatches) are right on canned run directories, and ``--quick`` (8 groups,
a kill or two) runs end to end with equal digests and every kill recovered.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from experiments.common import compose_job
from experiments.fault_tolerance import soak
from experiments.fault_tolerance.kill_every import load_run
from experiments.scale.seed_topology import (
    DATA_PARALLEL,
    DATA_PARALLEL_OVERRIDES,
    EXPERIMENT,
    FAULT_FREE,
    JobMemory,
    faulty_overrides,
    numbers,
    spread,
    table,
    targets,
)
from tests.canned_runs import canned_run, commit_record, write_jsonl
from tests.experiments.in_process import run_main

TIMEOUT_S = 240  # ~45 s on an idle two-core machine


def test_seed_topology_presets_compose():
    job = compose_job([], EXPERIMENT)
    assert (job.algo.name, job.algo.sync_every, job.algo.fragments, job.algo.delay) == ("streaming", 20, 2, 1)
    assert (job.cluster.groups, job.cluster.workers_per_group, job.cluster.spawn) == (30, 1, "fork")
    for period in (15.0, 60.0):
        faults = compose_job(faulty_overrides(period), EXPERIMENT).faults
        assert (faults.kill_every, faults.hang_every, faults.min_alive) == (period, 150.0, 2)
    ddp = compose_job(DATA_PARALLEL_OVERRIDES, EXPERIMENT)
    assert (ddp.algo.name, ddp.algo.sync_every, ddp.cluster.groups, ddp.faults.kill_every) == ("ddp", 1, 30, 0)


def _canned(tmp_path, name, faults, goodput, last_step_at, events=(), commits=None):
    """A 3-group run whose groups log their last step (100) at ``last_step_at`` s after launch."""
    run_dir = canned_run(tmp_path, name, faults, goodput)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary |= {"death_to_first_commit_s": {"count": 0}, "survivor_stall_s": {"count": 0}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    write_jsonl(run_dir / "events.jsonl", list(events))
    for group in range(3):
        write_jsonl(run_dir / "metrics" / f"group{group}.jsonl", [{"step": 100, "time": last_step_at, "train/loss": 2}])
        write_jsonl(run_dir / "commits" / f"group{group}.jsonl", (commits or {}).get(group, []))
    return load_run(name, run_dir, 20, start=0.0)


def test_efficiencies_stalls_and_table_on_canned_runs(tmp_path):
    base = _canned(tmp_path, FAULT_FREE, {}, 100.0, last_step_at=50.0)
    # The faulty run reaches step 100 at 80 s instead of 50 (step efficiency 62.5%) and commits
    # half the tokens per second (goodput over its 60 s wall time, measured to 80 s: 0.5 * 60 / 80).
    # Group 1 hangs at 10 s; group 0's next round takes 3 s more than its usual 0.1 s.
    usual = [commit_record(r, t, 7, "a", sync_ms=100) for r, t in ((1, 5.0), (2, 8.0), (3, 9.0))]
    commits = {
        0: [*usual, commit_record(4, 14.0, 7, "b", sync_ms=3100), commit_record(5, 16.0, 7, "c", sync_ms=100)],
        2: [commit_record(4, 14.0, 8, "x", sync_ms=100)],  # round 4 committed with another digest
    }
    hang = {"time": 10.0, "kind": "hang", "group": 1}
    kill = {"time": 20.0, "kind": "kill", "group": 2}
    faulty = _canned(tmp_path, "kill every 15 s", {"kill": 1, "hang": 1}, 50.0, 80.0, [hang, kill], commits)
    memory = {"rss_mib": 900.0, "pss_mib": 300.0, "processes": 4}
    figures = {name: numbers(run, base, memory, 1.6) for name, run in ((FAULT_FREE, base), (faulty.name, faulty))}

    f = figures[faulty.name]
    assert (f["kills"], f["hangs"], f["digest_mismatches"], f["goodput_ratio"]) == (1, 1, 1, 0.5)
    assert f["step_efficiency"] == pytest.approx(50 / 80)
    assert f["training_efficiency"] == pytest.approx(0.5 * 50 / 80)
    assert f["hang_stall_s"]["count"] == 1 and f["hang_stall_s"]["median"] == pytest.approx(3.0)
    assert figures[FAULT_FREE]["step_efficiency"] == figures[FAULT_FREE]["training_efficiency"] == 1.0

    text = table(figures, {FAULT_FREE: None, faulty.name: 15.0})
    assert "| step / training efficiency | 100.0% / 100.0% | 62.5% / 31.2% |" in text, text
    assert "| fault-tolerant Llama blog: step / training efficiency | n/a | 30.2% / 13.4% |" in text, text
    assert "| survivors' stall per hang s (median / max) | n/a | 3.00 / 3.00 (n=1) |" in text, text
    assert "| peak memory of the job MiB: sum of PSS / sum of RSS | 300 / 900 (4 proc.) |" in text, text
    assert "| final eval loss vs data parallel, same tokens | +25.00% | +25.00% |" in text, text  # 2.0 / 1.6
    without = numbers(faulty, base, memory)
    assert "| final eval loss vs data parallel, same tokens | n/a |" in table({FAULT_FREE: without}, {FAULT_FREE: None})
    lines = targets(figures)
    assert lines[0].startswith("kill every 15 s: 0 digest mismatches: FAIL"), lines
    assert lines[1].startswith("kill every 15 s: final eval loss within 3% of fault-free: PASS"), lines


def test_spread_and_job_memory_count_a_child():
    assert spread([]) == {"count": 0}
    assert spread([float(v) for v in range(1, 11)]) == {"count": 10, "median": 5.5, "p90": 9.0, "max": 10.0}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with JobMemory(every_s=0.05) as memory:
            deadline = time.monotonic() + 10
            while memory.peak_processes < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    figures = memory.figures()
    assert figures["processes"] >= 2, figures  # this process and the child, at least
    assert 0 < figures["pss_mib"] <= figures["rss_mib"], figures


@pytest.mark.slow
def test_seed_topology_quick(tmp_path, capsys):
    """8 groups, 100 steps each (--steps skips the calibration), faults from 6 s: a kill every 8 s,
    and the job lasts past the second one (~14 s), since under load the first one finds too few
    groups holding the state yet (faults.min_alive) and is skipped; then data parallel on the same
    tokens, fault-free, each run's final eval loss against its. The same run directories are read back
    with soak.py's figures, table and targets: the soak's machinery is this (Streaming DiLoCo,
    kills, soak's Progress and digest check), so its own smoke test needs no run."""
    args = ["--quick", "--steps", "100", "--results", str(tmp_path), "--keep-runs", str(tmp_path / "runs")]
    out, _ = run_main("experiments.scale.seed_topology", args, TIMEOUT_S, capsys)
    figures = json.loads((tmp_path / "seed_topology.json").read_text())
    assert list(figures) == [FAULT_FREE, "kill every 8 s", DATA_PARALLEL], out
    faulty, clean, ddp = figures["kill every 8 s"], figures[FAULT_FREE], figures[DATA_PARALLEL]
    assert faulty["ok"] and clean["ok"] and ddp["ok"], out
    assert ddp["bytes_per_token"] > 0 and ddp["overrides"] == DATA_PARALLEL_OVERRIDES, ddp
    vs = clean["final_eval_loss"] / ddp["final_eval_loss"] - 1
    assert clean["vs_data_parallel"] == pytest.approx(vs) and f"| {vs:+.2%} |" in out, out
    assert faulty["groups"] == 8 and faulty["kills"] > 0 and faulty["recoveries"] > 0, out
    assert faulty["digest_mismatches"] == 0 and clean["digest_mismatches"] == 0 and faulty["rounds_checked"] > 0, out
    assert faulty["memory"]["processes"] >= 9, out  # supervisor, fork server, lighthouse?, 8 workers
    assert "| step / training efficiency |" in out, out

    [kept] = (tmp_path / "runs" / EXPERIMENT).iterdir()
    runs = {
        soak.FAULTY: load_run(soak.FAULTY, kept / "kill every 8 s", 20, start=0.0),
        soak.FAULT_FREE: load_run(soak.FAULT_FREE, kept / FAULT_FREE, 20, start=0.0),
    }
    soaked = {name: soak.numbers(run, runs[soak.FAULT_FREE]) for name, run in runs.items()}
    assert soaked[soak.FAULTY]["kills"] == faulty["kills"] and soaked[soak.FAULTY]["recoveries"] > 0, soaked
    assert soaked[soak.FAULTY]["digest_mismatches"] == 0 and soaked[soak.FAULTY]["rounds_checked"] > 0, soaked
    assert soaked[soak.FAULT_FREE]["kills"] == 0 and all(n["ok"] for n in soaked.values()), soaked
    text = soak.table(soaked)
    for label, _ in soak.ROWS:
        assert re.search(rf"^\| {re.escape(label)} \| .+ \| .+ \|$", text, re.MULTILINE), text
    lines = soak.targets(soaked, quick=True)
    assert len(lines) == 4 and all(re.search(r": (PASS|FAIL)", line) for line in lines), lines
    assert lines[1].startswith("0 digest mismatches after every committed round: PASS"), lines
    assert lines[3].startswith("both runs ok: PASS"), lines
