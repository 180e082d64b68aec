"""experiments/fault_tolerance/own_loop.py: a Hugging Face Llama in one's own loop, trained as two replica groups
under ``python -m diloco.launch.script_groups`` on a corpus ``role=prepare`` made, one group's
worker SIGKILLed after its first committed round (torchrun restarts it, and it heals from its peer)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.launch.local_cluster import wait_until
from tests.conftest import REPO, process_exited

WORDS = ("the", "a", "cat", "dog", "bird", "sat", "ran", "flew", "on", "under", "near", "mat", "tree", "house", "red")
STEPS = 300  # long enough that the killed group usually rejoins mid-run; healing at the end passes too


def _corpus(folder: Path) -> None:
    """Sentences over a small vocabulary, one per line: a structure a tiny model learns within a few
    hundred steps, so the loss falls well below uniform over the tokens."""
    folder.mkdir()
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) + "." for _ in range(3000)]
    (folder / "sentences.txt").write_text("\n".join(lines) + "\n")


def _committed(commits: Path) -> list[dict]:
    if not commits.exists():
        return []
    records = [json.loads(line) for line in commits.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("committed")]


def _children(pid: int) -> list[int]:
    """``pid``'s child processes, from every one of its threads' children lists."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _kill_job(run_dir: Path, launcher: subprocess.Popen) -> None:
    """After a failure: SIGKILL the groups' workers and torchrun agents (each in a session of its own,
    so killing the launcher alone would leave them running), then the launcher."""
    groups = run_dir / "groups.json"
    agents = json.loads(groups.read_text()).values() if groups.exists() else []
    for agent in agents:
        try:
            for pid in [*_children(agent), agent]:
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass
    launcher.kill()
    launcher.wait(timeout=60)


def _losses(log: str, what: str) -> list[float]:
    return [float(x) for x in re.findall(rf"{what} (\d+\.\d+)", log)]


@pytest.mark.slow
def test_own_loop_heals_a_killed_group_and_learns(tmp_path):
    """The example end to end as a user runs it: the launcher's verdict (exit 0, one final digest)
    must hold through a SIGKILL, the restarted group must heal rather than fork, and the loop must learn."""
    _corpus(tmp_path / "text")
    prepared = tmp_path / "prepared"
    prepare = subprocess.run(
        [
            sys.executable,
            "run.py",
            "role=prepare",
            f"prepare.input={tmp_path / 'text'}",
            f"prepare.output={prepared}",
            "prepare.vocab_size=300",
            "prepare.text_unit=line",
            f"hydra.run.dir={tmp_path / 'prepare_run'}",
        ],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert prepare.returncode == 0, prepare.stdout + prepare.stderr

    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diloco.launch.script_groups",
            "--groups=2",
            "--max-restarts=1",
            f"--run-dir={run_dir}",
            "--timeout=240",
            "experiments/fault_tolerance/own_loop.py",
            f"--data={prepared / 'tokens.bin'}",
            f"--steps={STEPS}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        exited = process_exited(launcher, lambda: launcher.communicate()[0])
        commits = run_dir / "commits" / "group1.jsonl"
        wait_until(lambda: bool(_committed(commits)), 120, "group 1's first committed round", 0.1, exited)
        agent = json.loads((run_dir / "groups.json").read_text())["1"]
        worker = _committed(commits)[0]["pid"]  # the group's leader, which wrote the record
        assert worker in _children(agent), "the worker that committed runs under group 1's torchrun"
        os.kill(worker, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=240)
    except BaseException:
        _kill_job(run_dir, launcher)
        raise
    logs = {g: (run_dir / "logs" / f"group{g}.log").read_text() for g in (0, 1)}
    assert launcher.returncode == 0, output + logs[0][-3000:] + logs[1][-3000:]
    assert "done: 2 groups" in output, output

    results = [json.loads((run_dir / "results" / f"group{g}.json").read_text()) for g in (0, 1)]
    assert [r["end"]["holders"] for r in results] == [["group0", "group1"]] * 2, results
    assert results[0]["digest"] == results[1]["digest"] == results[0]["end"]["digest"]
    assert all(
        f"digest {results[0]['digest']} rounds" in log and "holds_final_model True" in log for log in logs.values()
    )
    assert results[1]["recoveries"] >= 1 and "healed from a peer" in logs[1], logs[1][-3000:]
    assert results[1]["steps"] == results[0]["steps"] == STEPS

    first, held_out = _losses(logs[0], "loss")[0], _losses(logs[0], "held-out loss")
    assert held_out == _losses(logs[1], "held-out loss"), "both groups evaluate the same final model"
    assert first > held_out[0] + 1.0, (first, held_out)  # from ~ln(300) = 5.7 at the start


@pytest.mark.slow
def test_own_loop_without_a_corpus_is_refused_once_not_restarted(tmp_path):
    """A missing corpus is met again on every start: the script refuses (``diloco.refuse``), torchrun
    does not start the group again, and the launcher names the group and the fix in one line."""
    run_dir = tmp_path / "run"
    missing = tmp_path / "corpus" / "tokens.bin"
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "diloco.launch.script_groups",
            "--groups=2",
            "--max-restarts=3",
            f"--run-dir={run_dir}",
            "--timeout=120",
            "experiments/fault_tolerance/own_loop.py",
            f"--data={missing}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert job.returncode == 1, job.stdout + job.stderr
    line = job.stderr.strip().splitlines()[-1]
    assert line.startswith("job failed: group") and "was refused, and not restarted: error: --data " in line, line
    assert f"{missing}: no such token file; prepare a corpus first" in line, line
    for g in (0, 1):
        log = (run_dir / "logs" / f"group{g}.log").read_text()
        assert log.count("no such token file") <= 1 and "will restart worker group" not in log, log[-3000:]
