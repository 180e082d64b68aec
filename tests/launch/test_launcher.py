"""The launcher's hold on its run directory: one launcher per directory, freed when it ends."""

from __future__ import annotations

import fcntl
import os

import pytest

from diloco.config.base import ConfigError
from diloco.launch.launcher import run_dir_claimed
from diloco.run_paths import RunPaths


def test_a_run_directory_held_by_another_launcher_is_refused_naming_it(tmp_path):
    paths = RunPaths(tmp_path)
    with open(paths.launcher_lock, "w") as other:  # another open file: flock treats it as another launcher
        other.write("4242\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX)
        with pytest.raises(ConfigError) as refused, run_dir_claimed(paths):
            pass
        assert str(refused.value) == (
            f"hydra.run.dir={tmp_path}: another launcher (pid 4242) is running a job there; pick a new hydra.run.dir"
        )
    with run_dir_claimed(paths), run_dir_claimed(paths):  # freed with the other; run.py and launch() both claim
        assert paths.launcher_lock.read_text().split() == [str(os.getpid())]
    with run_dir_claimed(paths):  # and freed again when this process's claim ends
        pass


def test_a_run_directory_with_a_finished_run_is_refused_under_the_claim(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a run"), run_dir_claimed(RunPaths(tmp_path)):
        pass
    with open(RunPaths(tmp_path).launcher_lock) as lock:  # the refusal let go of the directory
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
