"""``python -m diloco.launch.script_groups``: one's own script run as groups, and its honest verdict.

A healed kill through it is tested with the example it runs (tests/experiments/test_own_loop.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diloco.config.base import ConfigError
from diloco.launch.script_groups import parse, verdict
from diloco.run_paths import RunPaths
from tests.conftest import REPO


def write_result(paths: RunPaths, group: int, digest: str, holders: list[str]) -> None:
    paths.result(group).parent.mkdir(parents=True, exist_ok=True)
    record = {"group": group, "digest": digest, "rounds": 4, "recoveries": 0, "end": {"holders": holders}}
    paths.result(group).write_text(json.dumps(record))


def test_ok_only_when_every_group_exited_0_and_the_holders_agree(tmp_path, capsys):
    paths = RunPaths(tmp_path)
    both = ["group0", "group1"]
    write_result(paths, 0, "aa", both)
    assert "group1 exited 0 without a result" in verdict({0: 0, 1: 0}, paths, 2)
    write_result(paths, 1, "bb", both)
    assert "disagree" in verdict({0: 0, 1: 0}, paths, 2)
    assert verdict({0: 0, 1: 1}, paths, 2).startswith("group1 exited 1")
    assert "still running" in verdict({0: None, 1: 0}, paths, 2)
    write_result(paths, 1, "bb", ["group1"])  # group 0 fell behind: not a holder, so not compared
    write_result(paths, 0, "aa", ["group1"])
    assert verdict({0: 0, 1: 0}, paths, 2) is None
    assert "1 holding one final model (digest bb" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--groups", "0", "x.py"], "--groups=0: must be >= 1"),
        (["--max-restarts", "-1", "experiments/fault_tolerance/own_loop.py"], "--max-restarts must be >= 0"),
        (["no_such_script.py"], "no_such_script.py: no such script"),
    ],
)
def test_bad_arguments_get_one_line(argv, message, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=message):
        parse(argv)


@pytest.mark.slow
def test_a_group_whose_script_fails_fails_the_job_in_one_line(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['DILOCO_GROUP'] == '1' else 0)\n")
    command = [sys.executable, "-m", "diloco.launch.script_groups", "--max-restarts", "0"]
    command += ["--run-dir", str(tmp_path / "run"), str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("job failed: group1 exited 1"), result.stderr
    assert "DILOCO_LIGHTHOUSE_TOKEN" not in (tmp_path / "run" / "groups.json").read_text()
