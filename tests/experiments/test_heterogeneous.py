"""experiments/fault_tolerance/heterogeneous.py: its numbers and table on canned runs (fast), and one smoke run
with a real straggler (slow)."""

from __future__ import annotations

import json

import pytest

from experiments.fault_tolerance.heterogeneous import (
    STEPS,
    TIME,
    Run,
    load_run,
    numbers,
    table,
    targets,
    time_bounded_steps,
)
from tests.experiments.in_process import run_main

TOKENS_PER_STEP = 1024


def _run(steps_per_window: tuple[int, int], rounds: int, seconds: float, loss: float) -> Run:
    """A canned two-group run: group 1 is the slow one."""
    per_group = [
        {"group": g, "train_seconds": seconds - g, "tokens_seen": n * rounds * TOKENS_PER_STEP, "digest": "d"}
        for g, n in enumerate(steps_per_window)
    ]
    summary = {"ok": True, "rounds": rounds, "final_eval_loss": loss, "per_group": per_group, "groups": 2}
    summary |= {"train_seconds": seconds, "tokens_seen": sum(g["tokens_seen"] for g in per_group)}  # as summary.json
    commits = {g: [{"committed": r > 0} for r in range(rounds + 1)] for g in range(2)}
    return Run(summary, commits, [])


def test_equal_tokens_means_more_steps_for_the_time_bounded_run():
    assert time_bounded_steps(1000, 2, 2.0, 50) == 1350  # 1000 · 2 / 1.5 = 1333, to a multiple of 50
    assert time_bounded_steps(200, 2, 2.0, 20) == 260
    assert time_bounded_steps(1000, 2, 1.0, 50) == 1000, "no straggler: the same steps"
    assert time_bounded_steps(1000, 4, 2.0, 50) == 1150  # 4 / 3.5


def test_numbers_and_table_from_canned_runs():
    fixed = numbers(_run((20, 20), rounds=10, seconds=20.0, loss=2.0), 1, TOKENS_PER_STEP)
    timed = numbers(_run((20, 10), rounds=13, seconds=13.0, loss=2.01), 1, TOKENS_PER_STEP)
    assert fixed["throughput"] == 400 * TOKENS_PER_STEP / 20.0
    assert timed["slow_steps_per_window"] == 10 and fixed["slow_steps_per_window"] == 20
    assert timed["slow_rounds"] == 13 and timed["digests_agree"]
    figures = {STEPS: fixed, TIME: timed}
    text = table(figures, 20)
    assert (
        "| time-bounded (algo.window=time) | 13.0 | 399,360 | 30,720 | 1.50x | 2.0100 | +0.50% | 10.0 of 20 | 13 / 13 |"
        in text
    )
    checks = "\n".join(targets(figures))
    assert "1.50x PASS" in checks and "+0.50% PASS" in checks and "digests equal: PASS" in checks
    worse = {STEPS: fixed, TIME: numbers(_run((20, 10), 13, 19.0, 2.03), 1, TOKENS_PER_STEP)}
    checks = "\n".join(targets(worse))
    assert "1.03x FAIL" in checks and "+1.50% FAIL" in checks


def test_a_run_directory_is_read_back(tmp_path):
    for name in ("commits", "metrics"):
        (tmp_path / name).mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"groups": 2, "ok": True}))
    for g in range(2):
        (tmp_path / "commits" / f"group{g}.jsonl").write_text(json.dumps({"committed": True, "group": g}) + "\n")
    (tmp_path / "metrics" / "group0.jsonl").write_text(json.dumps({"time": 1.0, "train/loss": 3.0}) + "\n")
    run = load_run(tmp_path)
    assert run.commits[1] == [{"committed": True, "group": 1}] and run.metrics == [{"time": 1.0, "train/loss": 3.0}]


@pytest.mark.slow
def test_heterogeneous_quick(tmp_path, capsys):
    """A real straggler: with fixed H it runs every step of every window; with time-bounded windows
    it runs fewer and still takes part in every round. (Throughput is reported, not asserted:
    a smoke run on a shared CPU is noisy.)"""
    run_main(
        "experiments.fault_tolerance.heterogeneous",
        ["--quick", "--steps", "40", "--results", str(tmp_path)],
        240,
        capsys,
    )
    figures = json.loads((tmp_path / "heterogeneous.json").read_text())
    fixed, timed = figures[STEPS], figures[TIME]
    for n in (fixed, timed):
        assert n["ok"] and n["digests_agree"] and n["slow_rounds"] == n["rounds"], figures
    assert fixed["slow_steps_per_window"] == 20, figures
    assert timed["slow_steps_per_window"] < 0.8 * 20, figures
    assert "| fixed H (algo.window=steps) |" in (tmp_path / "heterogeneous.md").read_text()
