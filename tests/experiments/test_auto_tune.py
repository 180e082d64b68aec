"""experiments/communication/auto_tune.py: its numbers and table on canned runs (fast), and one smoke run over
a limited link (slow)."""

from __future__ import annotations

import json

import pytest

from experiments.communication.auto_tune import (
    link_kinds,
    link_name,
    model_seconds_per_byte,
    numbers,
    table,
    verdict_line,
)
from tests.experiments.in_process import run_main


def _canned(run_dir, train_s: float, loss: float, delays: list[int] | None) -> None:
    (run_dir / "commits").mkdir(parents=True)
    per_group = [{"train_seconds": train_s - g, "digest": "d"} for g in range(2)]
    summary = {"ok": True, "final_eval_loss": loss, "per_group": per_group, "groups": 2, "train_seconds": train_s}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    records = [{"committed": False, "sync_ms": 1.0}]
    for i, delay in enumerate(delays or [1, 1, 1]):
        plan = {} if delays is None else {"delay": delay, "quantize": "fp4", "link_s_per_byte": 8e-6 * (i + 1)}
        records.append({"committed": True, "sync_ms": 10.0 * (i + 1)} | plan)
    (run_dir / "commits" / "group0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_numbers_table_and_verdict_from_canned_runs(tmp_path):
    _canned(tmp_path / "fixed", 20.0, 2.0, None)
    _canned(tmp_path / "auto", 15.0, 2.02, [1, 4, 6])
    fixed, auto = numbers(tmp_path / "fixed"), numbers(tmp_path / "auto")
    assert fixed["plan"] is None and auto["plan"] == "τ=6, fp4", "the last committed round's plan"
    assert auto["train_s"] == 15.0 and auto["rounds"] == 3 and auto["round_ms"] == 20.0
    assert fixed["link_s_per_byte"] is None and auto["link_s_per_byte"] == 16e-6, "the median of what auto measured"
    fixed["model_s_per_byte"] = auto["model_s_per_byte"] = model_seconds_per_byte(1.0, 2)
    figures = {"netns": {link_name(1.0): {"fixed": fixed, "auto": auto}}}
    text = table(figures, "τ=1, fp4")
    assert "| 1 Mbit/s | netns | fixed | τ=1, fp4 | — | 8 | 20.0 | 1.00x | 20 | 2.0000 | +0.00% |" in text
    assert "| 1 Mbit/s | netns | auto | τ=6, fp4 | 16 | 8 | 15.0 | 0.75x | 20 | 2.0200 | +1.00% |" in text
    assert verdict_line(figures["netns"]["1 Mbit/s"]) == (
        "0.75x the fixed plan's training time, final eval loss +1.00%; runs ok with equal digests: True"
    )
    assert link_name(0.0) == "unlimited"
    assert model_seconds_per_byte(0.0, 2) is None and model_seconds_per_byte(2.0, 4) == pytest.approx(4e-6)


def test_link_kinds_skip_the_kernel_link_with_its_reason(monkeypatch, capsys):
    monkeypatch.setattr("experiments.communication.auto_tune.unavailable", lambda: "needs root")
    assert link_kinds("both") == ("bucket",)
    assert "--link netns skipped: needs root" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="needs root"):
        link_kinds("netns")
    monkeypatch.setattr("experiments.communication.auto_tune.unavailable", lambda: None)
    assert link_kinds("both") == ("bucket", "netns") and link_kinds("bucket") == ("bucket",)


@pytest.mark.slow
def test_auto_tune_quick(tmp_path, capsys):
    """Over a 0.5 Mbit/s link the preset's τ=1 cannot hide a fragment's fp4 all-reduce: the auto run
    ends on a larger τ; both runs end ok with equal digests. 80 steps: 4 fragment rounds (H=40, P=2),
    the first on the preset's plan and three re-planned."""
    args = ["--quick", "--steps", "80", "--links", "0.5", "--results", str(tmp_path)]
    run_main("experiments.communication.auto_tune", args, 240, capsys)
    runs = json.loads((tmp_path / "auto_tune.json").read_text())["bucket"]["0.5 Mbit/s"]
    assert all(n["ok"] and n["digests_agree"] for n in runs.values()), runs
    assert runs["fixed"]["plan"] is None
    delay = int(runs["auto"]["plan"].split(",")[0].removeprefix("τ="))
    assert delay > 1, runs
