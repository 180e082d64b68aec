"""A multi-host job on loopback, run as docs/fault-tolerance.md ("Many hosts") says: a lighthouse and each group
under torchrun as separate commands sharing one run directory; the lighthouse writes the job's
summary.json once it ends (``role=summary`` writes the same from the directory afterwards)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from diloco.launch.local_cluster import free_port
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_a_multi_host_job_on_loopback_ends_with_one_summary_whose_digests_agree(tmp_path):
    token = secrets.token_hex(16)
    (tmp_path / "run42.token").write_text(token + "\n")  # outside the run directory, as the docs say
    common = ["name=run42", "cluster.groups=2", "cluster.workers_per_group=1", "cluster.device=cpu", "logger=none"]
    common += ["trainer.max_steps=40", "algo.sync_every=10", "trainer.eval_every=0", "trainer.eval_batches=2"]
    common += [f"cluster.lighthouse.port={free_port('127.0.0.1')}"]
    common += [f"cluster.lighthouse.token_file={tmp_path / 'run42.token'}"]
    run_dir = tmp_path / "run"
    lighthouse = subprocess.Popen(
        [sys.executable, "run.py", "role=lighthouse", *common, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    # Two "hosts" share this machine's cores: one thread each, or their spinning threads take turns
    # (each group's 10 steps took 3-8 s instead of 0.5).
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    groups = [
        subprocess.Popen(
            [*torchrun, "run.py", "role=group", f"group.id={g}", *common, f"hydra.run.dir={run_dir}"],
            cwd=REPO,
            env=one_thread,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for g in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in [*groups, lighthouse]]
    finally:
        for process in [*groups, lighthouse]:
            if process.poll() is None:
                process.kill()
    for process, output in zip([*groups, lighthouse], outputs):
        assert process.returncode == 0, output[-3000:]
    assert "job 'run42' ended at round" in outputs[-1] and "done: eval loss" in outputs[-1], outputs[-1]
    by_lighthouse = json.loads((run_dir / "summary.json").read_text())
    assert by_lighthouse["ok"] and by_lighthouse["groups_missing_results"] == [], by_lighthouse["failure"]
    (run_dir / "summary.json").unlink()
    summarized = subprocess.run(
        [sys.executable, "run.py", "role=summary", *common, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summarized.returncode == 0, summarized.stdout + summarized.stderr
    assert "done: eval loss" in summarized.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and summary["groups_missing_results"] == [], summary["failure"]
    assert len({r["digest"] for r in summary["per_group"]}) == 1 and summary["final_round"] >= 4
    assert sorted(summary["model_saved_by_groups"]) == [0, 1] and (run_dir / "model.pt").exists()
    assert {k: v for k, v in summary.items() if k != "wall_seconds"} == {
        k: v for k, v in by_lighthouse.items() if k != "wall_seconds"
    }
    holding = [str(p) for p in run_dir.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert not holding and token not in "".join(outputs), holding  # DESIGN.md invariant 8


def test_role_summary_of_a_directory_without_results_says_where_to_point_it(tmp_path):
    done = subprocess.run(
        [sys.executable, "run.py", "role=summary", "logger=none", f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert f"error: hydra.run.dir={tmp_path}: no group wrote a result here" in done.stderr
