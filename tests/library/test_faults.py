"""Faults through the library: a group whose own loop raises, or whose process is killed, costs the
job that group's work only; the others train on to the end and a restarted group heals from them."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.library.conftest import PROJECT_LOOP, SMALL, write_job

pytestmark = pytest.mark.slow

# The groups' own bounds shortened too: a round with a dead peer fails in seconds, not the job's 30 s.
QUICK = [*SMALL, "cluster.timeouts.collective=10", "cluster.timeouts.end=20"]


def test_a_group_whose_loop_raises_leaves_the_other_to_train_to_the_end(lighthouse, start_group, tmp_path):
    """Group 1 raises at inner step 15 (of 40, H=10): it leaves the job with the error, and group 0
    runs its 40 steps and ends holding the job's final model, after one heartbeat timeout at most."""
    job_json = write_job(tmp_path / "job.json", QUICK)
    # The lighthouse cannot tell a group gone for good from one about to be restarted: the job's
    # end waits end_timeout_s for it after group 0 finished. Short here: nobody restarts group 1.
    server = lighthouse(end_timeout_s=3.0)
    survivor = start_group(0, server.url, PROJECT_LOOP, job_json, tmp_path / "g0.pt")
    failing = start_group(1, server.url, PROJECT_LOOP, job_json, tmp_path / "g1.pt", "--raise-at", "15")
    assert failing.wait(60) != 0
    assert "UserStop: the user's loop failed at inner step 15" in failing.output(), failing.output()
    assert survivor.wait(60) == 0, survivor.output()
    assert survivor.lines("step ")[-1] == "step 40"
    (result,) = survivor.lines("result ")
    _, _, rounds, holds = result.split()
    assert holds == "True" and int(rounds) >= 4, result
    assert not (tmp_path / "g1.pt").exists()
    assert torch.load(tmp_path / "g0.pt", weights_only=True).keys()


def test_a_killed_group_started_again_heals_from_its_peer_and_both_end_alike(lighthouse, start_group, tmp_path):
    """Group 1 is SIGKILLed after inner step 15; a fresh process of group 1 enters the block at the
    job's step (a heal from group 0, past its own 15), and both end with one digest."""
    job_json = write_job(tmp_path / "job.json", [*QUICK, "trainer.max_steps=60"])
    server = lighthouse(end_timeout_s=30.0)
    pace = ["--step-sleep", "0.1"]  # group 0 is still mid-job when the new group 1 has started
    peer = start_group(0, server.url, PROJECT_LOOP, job_json, tmp_path / "g0.pt", *pace)
    victim = start_group(1, server.url, PROJECT_LOOP, job_json, tmp_path / "g1.pt", *pace)
    victim.wait_for_line("step 15", timeout_s=60)
    victim.process.send_signal(signal.SIGKILL)
    assert victim.process.wait(timeout=30) == -signal.SIGKILL
    again = start_group(1, server.url, PROJECT_LOOP, job_json, tmp_path / "g1.pt", *pace)
    entered = int(again.wait_for_line("entered ", timeout_s=60).split()[1])
    assert entered > 15, again.output()  # it took the job's step from its peer, not its own 0 or 15
    assert peer.wait(90) == 0, peer.output()
    assert again.wait(60) == 0, again.output()
    results = [group.lines("result ")[0].split() for group in (peer, again)]
    assert results[0][1] == results[1][1], results  # one digest
    assert all(r[3] == "True" for r in results), results
    weights = [torch.load(tmp_path / f"g{g}.pt", weights_only=True) for g in range(2)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
