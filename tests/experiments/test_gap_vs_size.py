"""experiments/outer_recipe/gap_vs_size.py: it plans compare_ddp's three rows per model, and its table and exit
status are right on canned runs kept for two models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.outer_recipe.compare_ddp import CONFIG_FILE, CONFIGS
from experiments.outer_recipe.gap_vs_size import main, planned
from tests.experiments.test_compare_ddp import canned_run


def kept(
    where: Path, name: str, model: str, loss: float, parameters: int, steps: int = 1000, device: str = "cpu"
) -> None:
    """A finished compare_ddp run kept with ``--keep-runs``: its directory and its row's marker."""
    config = next(c for c in CONFIGS if c.name == name and c.groups == 2)
    canned_run(where, loss, [2.0, loss])
    summary = json.loads((where / "summary.json").read_text()) | {"parameters": parameters}
    (where / "summary.json").write_text(json.dumps(summary))
    marker = {"name": name, "groups": 2, "overrides": list(config.overrides), "model": model, "steps": steps, "seed": 1}
    marker["device"] = device
    (where / CONFIG_FILE).write_text(json.dumps(marker))


def test_every_model_gets_ddp_local_and_diloco_at_two_groups_with_its_own_preset(tmp_path):
    jobs = planned(["midi", "mini"], 1000, 1, "cpu", tmp_path)
    assert [(j.marker["model"], j.config.name, j.config.groups, j.seed) for j in jobs] == [
        ("midi", "ddp", 2, 1),
        ("midi", "local", 2, 1),
        ("midi", "diloco H=50", 2, 1),
        ("mini", "ddp", 2, 1),
        ("mini", "local", 2, 1),
        ("mini", "diloco H=50", 2, 1),
    ]
    assert [j.job.model.dim for j in jobs] == [256] * 3 + [128] * 3
    assert {j.job.trainer.max_steps for j in jobs} == {1000} and jobs[3].run_dir.parent == tmp_path / "mini"


def test_runs_of_several_models_make_one_row_each_smallest_first_and_a_missing_baseline_fails(tmp_path, capsys):
    kept(tmp_path / "a" / "run0", "ddp", "midi", 1.30, 4_600_000)
    kept(tmp_path / "a" / "run1", "local", "midi", 1.50, 4_600_000)
    kept(tmp_path / "a" / "run2", "diloco H=50", "midi", 1.32, 4_600_000)
    kept(tmp_path / "b" / "run0", "ddp", "mini", 1.40, 800_000)
    kept(tmp_path / "b" / "run1", "local", "mini", 1.60, 800_000)
    kept(tmp_path / "b" / "run2", "diloco H=50", "mini", 1.45, 800_000)
    main(["--collect", str(tmp_path), "--results", str(tmp_path / "out")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[4] == "| mini | 0.80M | 1000 | 1 | 1.4000 | 1.6000 | 1.4500 | +3.6% | 75% |"
    assert lines[5] == "| midi | 4.60M | 1000 | 1 | 1.3000 | 1.5000 | 1.3200 | +1.5% | 90% |"
    saved = json.loads((tmp_path / "out" / "gap_vs_size.json").read_text())
    assert [(p["model"], round(p["gap_closed"], 6)) for p in saved] == [("mini", 0.75), ("midi", 0.9)]

    kept(tmp_path / "c" / "run0", "diloco H=50", "small", 1.20, 19_100_000)  # its baselines never ran
    with pytest.raises(SystemExit, match="no gap closed .* for: small 1000 steps seed 1"):
        main(["--collect", str(tmp_path), "--results", str(tmp_path / "out")])
    assert "| small | 19.10M | 1000 | 1 | – | – | 1.2000 | – | – |" in capsys.readouterr().out


def test_a_length_compare_ddp_refuses_and_runs_of_two_devices_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="--steps=150: must be a positive multiple of 100"):
        main(["--models", "mini", "--steps", "150", "--keep-runs", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()
    kept(tmp_path / "a" / "run0", "diloco H=50", "mini", 1.45, 800_000)
    kept(tmp_path / "b" / "run0", "diloco H=50", "midi", 1.32, 4_600_000, device="cuda")
    with pytest.raises(SystemExit, match="--collect: runs of one device only"):
        main(["--collect", str(tmp_path), "--results", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
