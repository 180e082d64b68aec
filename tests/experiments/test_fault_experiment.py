"""experiments/fault_tolerance/kill_every.py runs end to end (``--quick``, fault-free and faulty): kills happen
and killed groups come back; its main() with the warm-spare run and its calibration on stand-ins.

The loss and stall targets are not required to PASS here (seconds of a tiny model on a
shared CPU are noisy). Recovery is: every kill must be followed by a healed restart, except a
kill that lands so close to the end of the job that no peer is left to heal from (the script
counts those as ``late_failures``; with kills further apart than a heal at most the last one can be),
or one before the job's first commit on a loaded machine, with no state to heal from (``early_failures``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from experiments.fault_tolerance import kill_every
from experiments.fault_tolerance.kill_every import FAULT_FREE, FAULTY, ROWS, SPARES, Run, load_run
from tests.canned_runs import canned_run, commit_record, write_jsonl
from tests.experiments.in_process import run_main

TIMEOUT_S = 300


@pytest.mark.slow
def test_fault_tolerance_quick(tmp_path, capsys):
    # --steps skips the calibration (covered by test_calibration_measures_steps_per_second_after_the_warmup;
    # its ClusterRun is bench_sync's): 8 to 11 s of training per run here, so a kill lands at 6 s, before
    # the job ends, and maybe one at 11 s (at most one too late to recover: kills come further apart than
    # a heal takes). The warm-spare run is left out: the library's
    # test_a_warm_spare_takes_over_a_killed_group_and_heals runs a takeover, and
    # test_fault_tolerance_main_with_a_warm_spare_on_canned_runs the script's spare column and targets.
    args = ["--quick", "--steps", "100", "--kill-every", "5", "--no-spares", "--results", str(tmp_path)]
    run_main("experiments.fault_tolerance.kill_every", args, TIMEOUT_S, capsys)
    table = (tmp_path / "fault_tolerance.md").read_text()
    assert "| kills injected |" in table and "every killed group recovers:" in table, table
    figures = json.loads((tmp_path / "fault_tolerance.json").read_text())
    assert list(figures) == [FAULT_FREE, FAULTY], table
    faulty = figures[FAULTY]
    assert faulty["kills"] > 0, table
    assert faulty["late_failures"] <= 1 and faulty["early_failures"] <= 2, table
    unrecoverable = faulty["late_failures"] + faulty["early_failures"]
    assert faulty["recoveries"] >= faulty["kills"] - unrecoverable, table
    assert faulty["time_to_heal_s"].get("count", 0) >= faulty["recoveries"], table
    assert faulty["digests_equal"] and figures[FAULT_FREE]["digests_equal"], table
    choices = faulty["recovery_choices"]
    # one choice per death that gets a replacement (a kill after the job's end gets none)
    assert choices["wait"] + choices["go_on"] >= faulty["kills"] - faulty["late_failures"], table
    # a measured cost for each death whose replacement committed a round (on a fast machine the one
    # kill at 6 s can land a second before the end, leaving none: test_recovery measures a cost by hand)
    measured = faulty["death_to_first_commit_s"].get("count", 0)
    assert choices["actual_cost_s"].get("count", 0) == measured, table
    for label, _ in ROWS:
        assert re.search(rf"^\| {re.escape(label)} \| .+ \| .+ \|$", table, re.MULTILINE), label
    for target in ("final eval loss within", "survivors stall under", "every killed group recovers:"):
        assert re.search(rf"^{re.escape(target)}.*(PASS|FAIL)", table, re.MULTILINE), target

    pytest.importorskip("matplotlib", reason="the script skips the PNG without matplotlib")
    assert (tmp_path / "fault_tolerance.png").stat().st_size > 0


def _ft_run(name: str, run_dir: Path, kills: int, spare: bool) -> Run:
    """A canned 3-group run as kill_every.load_run reads it: ``kills`` kills of group 1 at 5 s, 9 s, ...,
    each restarted (by a warm spare if ``spare``) and healed a second later; steps end at 20 s."""
    run_dir.mkdir(parents=True)
    back = {"count": kills, "median": 0.5, "p90": 0.5, "max": 0.5, "mean": 0.5} if kills else {"count": 0}
    choices = {"wait": 0, "go_on": kills, "predicted_cost_s": back, "actual_cost_s": back} if kills else {}
    summary = {
        "ok": True,
        "failure": None,
        "groups": 3,
        "steps": 100,
        "parameters": 130_000,
        "wall_seconds": 22.0,
        "faults": {"kill": kills, "restart": kills} if kills else {},
        "recoveries": kills,
        "syncs_committed": 9,
        "syncs_attempted": 10,
        "goodput_tokens_per_s": 1000.0 - 20 * kills * (not spare),
        "final_eval_loss": 2.0,
        "time_to_heal_s": back,
        "death_to_first_commit_s": back,
        "death_to_ready_s": back,
        "survivor_stall_s": back,
        "recovery_choices": choices,
        "per_group": [{"group": g, "digest": "d", "rounds": 5} for g in range(3)],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "job.json").write_text(json.dumps({"cluster": {"timeouts": {"join": 0.5}}}))
    events = []
    for i in range(kills):
        events += [{"time": 5.0 + 4 * i, "kind": "kill", "group": 1}]
        events += [{"time": 5.5 + 4 * i, "kind": "restart", "group": 1} | ({"spare": 0} if spare else {})]
    write_jsonl(run_dir / "events.jsonl", events)
    for group in range(3):
        commits = [commit_record(r, 4.0 * r, 100 + group, "d", sync_ms=100) for r in range(1, 6)]
        commits += [
            commit_record(2, 6.5 + 4 * i, 200 + i, "d", sync_ms=100, recoveries=1) for i in range(kills) if group == 1
        ]
        write_jsonl(run_dir / "commits" / f"group{group}.jsonl", sorted(commits, key=lambda c: c["time"]))
        write_jsonl(run_dir / "metrics" / f"group{group}.jsonl", [{"step": 100, "time": 20.0, "train/loss": 2.0}])
    return load_run(name, run_dir, 20, start=0.0)


def test_fault_tolerance_main_with_a_warm_spare_on_canned_runs(tmp_path, monkeypatch, capsys):
    """main() with the warm-spare run (the smoke run leaves it out), the jobs stood in for: each run's
    overrides, the spare column, its takeovers counted from the events and its two targets."""
    calls = []

    def run_one(name, overrides, run_dir, *args, **kwargs):
        calls.append((name, overrides))
        return _ft_run(name, run_dir, 0 if name == FAULT_FREE else 2, spare=name == SPARES)

    monkeypatch.setattr("experiments.fault_tolerance.kill_every.run_one", run_one)
    monkeypatch.setattr("experiments.fault_tolerance.kill_every.pyplot", lambda: None)
    monkeypatch.setattr("experiments.fault_tolerance.kill_every.stop_on_sigterm", lambda: None)
    monkeypatch.setattr(sys, "argv", ["kill_every.py", "--quick", "--steps", "100", "--results", str(tmp_path)])
    kill_every.main()
    out, _ = capsys.readouterr()
    assert [name for name, _ in calls] == [FAULT_FREE, FAULTY, SPARES]
    assert calls[0][1][0] == "faults=none" and calls[1][1][0] == "faults=kill_every"
    assert "cluster.spares=1" in calls[2][1] and "cluster.spares=1" not in calls[1][1]
    assert all("trainer.max_steps=100" in overrides for _, overrides in calls)
    text = (tmp_path / "fault_tolerance.md").read_text()
    assert text.strip() == out.strip()
    assert f"|  | {FAULT_FREE} | {FAULTY} | {SPARES} |" in text, text
    assert "| restarts (of them by a warm spare) | 0 (0) | 2 (0) | 2 (2) |" in text, text
    assert "| recoveries (restarted groups healed) | 0 | 2 | 2 |" in text, text
    assert "| death to first commit s (median / p90 / max) | n/a | 0.50 / 0.50 / 0.50 (n=2) |" in text, text
    assert "every killed group recovers: PASS (2 healed restarts for 2 kills;" in text, text
    assert "with a warm spare, goodput ratio >= 0.95: PASS (1.000; without: 0.960)" in text, text
    assert "with a warm spare, median death to first commit <= 1 s: PASS (0.50 s over 2 deaths;" in text, text
    spared = json.loads((tmp_path / "fault_tolerance.json").read_text())[SPARES]
    assert spared["spare_takeovers"] == 2 and spared["recoveries"] == 2 and spared["late_failures"] == 0, spared


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


class _GrowingRun:
    """ClusterRun's stand-in for calibrate(): group g logs step 10 * (1 + g) + rate * (seconds since start)."""

    def __init__(self, job, run_dir: Path) -> None:
        self.job, self.run_dir, self.cluster, self.started = job, run_dir, self, None

    def __enter__(self):
        self.started = kill_every.time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait_for(self, condition, timeout_s: float, what: str, poll_s: float) -> None:
        assert what == f"every group to reach step {kill_every.WARMUP_STEPS}" and condition(), what

    def metrics(self, group: int) -> list[dict]:
        now = kill_every.time.monotonic()
        step = kill_every.WARMUP_STEPS + 10 * group + 100 * (now - self.started) * (1 + group)
        return [{"step": 1, "time": 0.0, "train/loss": 5.0}, {"step": step, "time": now, "train/loss": 3.0}]


def test_calibration_measures_steps_per_second_after_the_warmup(tmp_path, monkeypatch):
    """The median over groups of the steps per second between the warm-up and the window's end, of an
    endless fault-free job of the experiment's preset; and the steps planned from it."""
    jobs = []
    monkeypatch.setattr(
        "experiments.fault_tolerance.kill_every.ClusterRun",
        lambda job, run_dir: jobs.append(job) or _GrowingRun(job, run_dir),
    )
    rate = kill_every.calibrate(tmp_path, 0.2, "soak", ("cluster.groups=3",))
    assert rate == pytest.approx(200, rel=0.05), "groups at 100, 200 and 300 steps/s: the median"
    [job] = jobs
    assert (job.cluster.groups, job.trainer.max_steps, job.faults.kill_every) == (3, kill_every.ENDLESS, 0)
    assert kill_every.plan_steps(10.0, 0.5, 20) == 360  # 10 steps/s x 30 s x 1.15, to a multiple of H
    assert kill_every.planned_steps(tmp_path, 140, 5.0, 20.0, 20) == (140, "--steps")
