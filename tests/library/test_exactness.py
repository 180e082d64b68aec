"""A plain loop of one's own through ``DiLoCo`` and ``python run.py`` are one outer path: with the
job's settings (its job.json) and this project's model, data and inner step, two groups of the
loop end with the very weights the job saves as model.pt, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from diloco.config.job import job_config_from_dict
from diloco.train.model import Transformer
from tests.conftest import REPO
from tests.library.conftest import PROJECT_LOOP, SMALL

pytestmark = pytest.mark.slow


def run_job(overrides: list[str], run_dir) -> None:
    """``python run.py`` as a user runs it, in ``run_dir``."""
    command = [sys.executable, "run.py", *overrides, f"hydra.run.dir={run_dir}"]
    try:
        result = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"run.py took over 90 s:\n{error.stdout}\n{error.stderr}")
    assert result.returncode == 0, result.stdout + result.stderr[-8000:]


@pytest.mark.parametrize(
    "algo",
    [
        pytest.param(
            ["algo=streaming", "algo.sync_every=10", "algo.fragments=2", "algo.delay=1", "algo.quantize=fp4"],
            id="streaming-fp4",
        ),
        # DiLoCo (one fragment) with SparseLoCo's payload: top-k 1%, 2 bits, error feedback, outer SGD
        pytest.param(["+experiment=sparseloco", "algo.sync_every=10"], id="diloco-sparseloco"),
    ],
)
def test_own_loop_ends_with_the_jobs_model_bit_for_bit(algo, lighthouse, start_group, tmp_path):
    # Every round must hold both groups in both runs: a round's first asker waits up to 5 s (not
    # 0.5 s) for the other, which on busy cores might otherwise miss one and sync alone.
    overrides = [*SMALL, "cluster.timeouts.join=5", *algo]
    started = time.monotonic()
    run_job(overrides, tmp_path / "job")
    job_json = tmp_path / "job" / "job.json"
    job = job_config_from_dict(json.loads(job_json.read_text()))
    assert job.trainer.max_steps == 40 and job.algo.sync_every == 10
    job_seconds = time.monotonic() - started

    server = lighthouse(job.cluster.quorum_rules())  # the job's own quorum rules
    outs = [tmp_path / f"own{g}.pt" for g in range(2)]
    groups = [start_group(g, server.url, PROJECT_LOOP, job_json, outs[g]) for g in range(2)]
    for group in groups:
        assert group.wait(90) == 0, group.output()
    own_seconds = time.monotonic() - started - job_seconds

    digests = {group.lines("result ")[0].split()[1] for group in groups}
    assert len(digests) == 1, digests
    job_summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert {g["digest"] for g in job_summary["per_group"]} == digests  # the same θ_g, by the job's own digest

    expected = torch.load(tmp_path / "job" / "model.pt", weights_only=True)
    torch.manual_seed(job.trainer.seed)
    initial = Transformer(job.model).state_dict()
    assert not torch.equal(expected["output.weight"], initial["output.weight"])  # it trained
    for out in outs:
        own = torch.load(out, weights_only=True)
        assert own.keys() == expected.keys()
        differing = {
            name: (own[name] - t).abs().max().item() for name, t in expected.items() if not torch.equal(own[name], t)
        }
        assert not differing, f"max abs differences: {differing}"
    print(f"job {job_seconds:.1f}s, own loop {own_seconds:.1f}s")
