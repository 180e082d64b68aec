"""experiments/fault_tolerance/own_loop_fsdp.py: a group's batch does not depend on its number of workers (fast);
2 groups x 2 FSDP2 workers run under ``diloco.launch.script_groups`` and end on one model, the
same, within float rounding, as 2 groups x 1 unsharded worker (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.run_paths import RunPaths
from diloco.train.model import Transformer
from experiments.fault_tolerance.own_loop_fsdp import model_config, parse_args, synthetic_batch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "experiments" / "fault_tolerance" / "own_loop_fsdp.py"
# 4 rounds (H=10, 2 fragments: one every 5 inner steps), on the CPU whatever the machine has.
SCRIPT_ARGS = ["--steps", "20", "--device", "cpu"]
JOB_TIMEOUT_S = 90  # the launcher's own --timeout: it stops its groups (their own sessions) itself
# Measured: at most 2.4e-7 (1-2 ulps of fp32 at the norms' weights ~1), from summation order alone:
# FSDP2 averages two half-batch mean gradients where one worker takes the mean of the whole batch,
# so a gradient differs in its last bits and AdamW carries that through each step. An error of
# the sharded path (a shard synced with the wrong peer, a lost fragment or round, a gradient not
# averaged) moves a weight by an inner step, lr = 3e-3, or more: 300x this tolerance.
ATOL = 1e-5


def test_a_groups_batch_is_the_same_whatever_its_number_of_workers():
    args = parse_args(["--batch", "8"])
    whole = synthetic_batch(1, 7, args, vocab=64)
    halves = [synthetic_batch(1, 7, args, vocab=64)[rank * 4 : (rank + 1) * 4] for rank in range(2)]
    assert torch.equal(torch.cat(halves), whole)
    assert not torch.equal(synthetic_batch(0, 7, args, vocab=64), whole), "each group reads its own data"
    assert not torch.equal(synthetic_batch(1, 8, args, vocab=64), whole), "and each step a new batch"
    steps = whole[:, 1:] - whole[:, :-1]
    assert ((steps % 64) == (steps[:, :1] % 64)).all(), "each row is one arithmetic progression mod the vocabulary"


def launch(run_dir: Path, workers: int, save: Path) -> None:
    """Run the script as 2 groups of ``workers`` under the launcher; fails the test with the logs if it fails."""
    command = [
        sys.executable,
        "-m",
        "diloco.launch.script_groups",
        "--groups=2",
        f"--workers-per-group={workers}",
        "--max-restarts=0",
        f"--timeout={JOB_TIMEOUT_S}",
        f"--run-dir={run_dir}",
        str(SCRIPT),
        *SCRIPT_ARGS,
        "--save",
        str(save),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False, timeout=JOB_TIMEOUT_S + 60)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert done.returncode == 0, f"{workers} workers per group failed:\n{done.stdout}\n{done.stderr[-4000:]}{logs}"


def full_rounds(paths: RunPaths) -> None:
    """Every round both groups committed had both in it: else the two runs' outer steps differ
    (α and the average depend on who took part) and their weights cannot be compared."""
    for group in range(2):
        records = [json.loads(line) for line in paths.commits(group).read_text().splitlines()]
        committed = [r for r in records if r["committed"]]
        assert len(committed) == 4, f"group {group} committed {len(committed)} rounds, not 4: {records}"
        partial = [r for r in committed if sorted(r["participants"]) != ["group0", "group1"]]
        assert not partial, f"a round ran without every group, so the runs are not comparable: {partial}"


@pytest.mark.slow
def test_fsdp2_in_each_group_ends_on_one_model_that_matches_unsharded_groups(tmp_path):
    runs = {}
    for workers in (2, 1):
        run_dir = tmp_path / f"workers{workers}"
        launch(run_dir, workers, tmp_path / f"final-{workers}-{{group}}.pt")
        paths = RunPaths(run_dir)
        results = [json.loads(paths.result(g).read_text()) for g in range(2)]
        assert all(sorted(r["end"]["holders"]) == ["group0", "group1"] for r in results), results
        assert len({r["digest"] for r in results}) == 1, f"the holders disagree: {results}"
        full_rounds(paths)
        runs[workers] = [torch.load(tmp_path / f"final-{workers}-{g}.pt") for g in range(2)]
        for name, value in runs[workers][1].items():  # one digest: the gathered weights must agree exactly
            assert torch.equal(value, runs[workers][0][name]), name

    sharded, whole = runs[2][0], runs[1][0]
    assert sharded.keys() == whole.keys()
    worst = max((sharded[name] - whole[name]).abs().max().item() for name in whole)
    assert worst <= ATOL, f"FSDP2 in the groups moved the final model by {worst:.3g} (tolerance {ATOL})"

    torch.manual_seed(0)  # the script's initial model: training must have moved far past the tolerance
    initial = Transformer(model_config(parse_args([]))).state_dict()
    moved = max((whole[name] - initial[name]).abs().max().item() for name in whole)
    assert moved > 100 * ATOL, f"the final model is {moved:.3g} from the initial one: nothing was compared"
