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
    assert not RunPaths(tmp_path).launcher_lock.exists()  # the refusal let go of the directory


def test_a_finished_claim_leaves_no_lock_file_and_holds_it_until_then(tmp_path):
    paths = RunPaths(tmp_path)
    with run_dir_claimed(paths), open(paths.launcher_lock) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not paths.launcher_lock.exists()


def test_a_lock_won_on_the_file_its_holder_just_removed_is_taken_anew(tmp_path, monkeypatch):
    """The holder removes launcher.lock before letting go: a launcher that opened it just before
    then locks a removed file, while a third one may already hold the new file at that path."""
    paths = RunPaths(tmp_path)
    paths.launcher_lock.write_text("1111\n")  # the leaving holder's file, opened by the claim below
    real_flock = fcntl.flock
    newcomer = []

    def holder_leaves_and_another_comes(handle, operation):
        if not newcomer:  # between the claim's open and its lock
            paths.launcher_lock.unlink()
            newcomer.append(open(paths.launcher_lock, "w"))  # noqa: SIM115 - closed below
            newcomer[0].write("4242\n")
            newcomer[0].flush()
            real_flock(newcomer[0], fcntl.LOCK_EX)
        real_flock(handle, operation)

    monkeypatch.setattr(fcntl, "flock", holder_leaves_and_another_comes)
    try:
        with pytest.raises(ConfigError, match=r"another launcher \(pid 4242\)"), run_dir_claimed(paths):
            pass
    finally:
        newcomer[0].close()
    assert paths.launcher_lock.read_text() == "4242\n"  # the refused claim removed nothing
