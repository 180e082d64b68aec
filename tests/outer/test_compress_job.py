"""algo.compress=topk in real jobs: launcher, lighthouse, worker processes, Gloo lanes on loopback."""

from __future__ import annotations

import pytest

from diloco.launch.launcher import launch
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from tests.conftest import compose_job
from tests.outer.regenerate_schedules import round_schedule

pytestmark = pytest.mark.slow

JOB = [
    "logger=none",
    "cluster.device=cpu",
    "cluster.workers_per_group=1",
    "trainer.seq_len=64",
    "trainer.batch_size=4",
    "trainer.eval_every=0",
    "trainer.eval_batches=2",
    "algo.compress=topk",
    "algo.density=0.02",
]


def test_a_two_group_streaming_job_with_topk_ends_ok_with_one_digest_and_counts_the_bytes_it_sent(tmp_path):
    job = compose_job(
        JOB
        + ["cluster.groups=2", "algo=streaming", "algo.quantize=none", "algo.sync_every=10", "algo.fragments=2"]
        + ["algo.delay=1", "algo.weighting=tokens", "trainer.max_steps=60"]
    )
    summary = launch(job, tmp_path)
    assert summary["ok"], summary.get("failure")
    assert len({g["digest"] for g in summary["per_group"]}) == 1
    commits = [r for r in read_jsonl(RunPaths(tmp_path).commits(0)) if r["committed"]]
    assert len(commits) == 60 // 5, "every fragment's round committed"
    rounds = [r for r in read_jsonl(RunPaths(tmp_path).metrics(0)) if "outer/pseudo_grad_norm" in r]
    assert len(rounds) == 60 // 5 and all(r["outer/error_norm"] > 0 for r in rounds), "e holds the 98% not sent"
    schedule = round_schedule(job)  # the golden schedules' recorder (test_golden_schedules.py), on this job
    assert [r["inner_step"] for r in commits] == [r["apply"] for r in schedule], "rounds where the schedule says"
    assert [r["outer/alpha"] for r in rounds] == pytest.approx([r["alpha"] for r in schedule])
    assert [r["outer/momentum"] for r in rounds] == pytest.approx([r["mu"] for r in schedule])
    dense = 2 * 6 * 4 * summary["parameters"]  # fp32 DiLoCo: each group sends the model once a cycle, 6 cycles
    assert dense / 200 < summary["bytes_sent"] < dense / 30, "2% of the entries, 14 bits each, and the scales"


def test_a_killed_group_heals_into_a_topk_job_and_every_group_ends_with_one_digest(tmp_path):
    job = compose_job(
        JOB
        + ["cluster.groups=3", "algo.sync_every=10", "trainer.max_steps=400", "faults=kill_every"]
        + ["faults.kill_every=6", "faults.start_after=4", "faults.stop_after=8", "cluster.restart_backoff=0.2"]
        + ["cluster.timeouts.collective=5", "cluster.timeouts.heartbeat=2"]
    )
    summary = launch(job, tmp_path)
    assert summary["ok"], summary.get("failure")
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert kinds.count("kill") >= 1 and kinds.count("restart") == kinds.count("kill"), kinds
    assert summary["time_to_heal_s"]["count"] == kinds.count("kill"), "every restarted group commits again"
    assert len({g["digest"] for g in summary["per_group"]}) == 1
