"""Faults through the library: a group whose own loop raises costs the job that group's work only;
the others train on to the end. A killed group that heals through the library, under torchrun:
tests/experiments/test_own_loop.py."""

from __future__ import annotations

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
