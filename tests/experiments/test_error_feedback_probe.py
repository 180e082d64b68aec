"""experiments/outer_recipe/error_feedback_probe.py on a real topk job's last checkpoint."""

from __future__ import annotations

import re

import pytest

from diloco.launch.launcher import launch
from tests.conftest import compose_job
from tests.experiments.in_process import run_main

pytestmark = pytest.mark.slow


def test_the_probe_reproduces_the_jobs_eval_at_c_0_and_moves_it_with_what_e_holds(tmp_path, capsys):
    job = compose_job(
        ["logger=none", "cluster.device=cpu", "cluster.groups=2", "cluster.workers_per_group=1", "model=tiny"]
        + ["trainer.seq_len=64", "trainer.batch_size=4", "trainer.max_steps=60", "trainer.eval_batches=2"]
        + ["algo=diloco", "algo.sync_every=10", "algo.compress=topk", "algo.density=0.02"]
        + ["trainer.checkpoint.every=60"]
    )
    summary = launch(job, tmp_path)
    assert summary["ok"], summary.get("failure")
    out, _ = run_main(
        "experiments.outer_recipe.error_feedback_probe", [str(tmp_path), "--scales", "0", "1"], 120, capsys
    )
    losses = {float(c): float(loss) for c, loss in re.findall(r"^\| ([\d.]+) \| ([\d.]+) \|", out, re.MULTILINE)}
    assert losses[0.0] == pytest.approx(summary["final_eval_loss"], abs=1e-4), out
    assert losses[1.0] != losses[0.0], "e held something back, and applying it moves the model"
    assert "2 groups" in out and "‖ē‖" in out
