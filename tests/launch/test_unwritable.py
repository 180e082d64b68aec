"""A run directory that cannot be made or written, and a disk that fills up under the launcher: one
line naming the folder or the file (``OutputError``), never hydra's mkdir traceback or an ENOSPC
traceback from the middle of the supervisor's loop."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
from typing import Self

import pytest

from diloco.files import OutputError, append_text
from diloco.ft.fault_requests import request_fault
from diloco.launch.compose import output_folder_problem, unwritable_folder
from diloco.launch.launcher import run_dir_claimed
from diloco.launch.local_cluster import LocalCluster
from diloco.launch.supervisor import EventLog
from diloco.run_paths import RunPaths
from tests.conftest import REPO, compose_job

FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_an_output_folder_the_os_will_not_create_is_refused_in_one_line():
    """Tests run as root, whom chmod does not stop: /proc refuses new folders to everyone."""
    assert output_folder_problem(["hydra.run.dir=/proc/foo"]) == (
        "error: hydra.run.dir=/proc/foo: cannot create or write /proc/foo (No such file or directory); "
        "pick another hydra.run.dir"
    )
    assert output_folder_problem(["hydra.run.dir=/proc/foo/${now:%H}/run"]).startswith(
        "error: hydra.run.dir=/proc/foo/${now:%H}/run: cannot create or write /proc/foo ("
    )
    assert output_folder_problem(["-m", "hydra.sweep.dir=/proc/sweep"]).startswith(
        "error: hydra.sweep.dir=/proc/sweep: cannot create or write /proc/sweep ("
    )


def test_an_existing_folder_that_takes_no_files_is_refused():
    assert output_folder_problem(["hydra.run.dir=/proc"]).startswith(
        "error: hydra.run.dir=/proc: cannot create or write"
    )


def test_an_empty_or_too_long_folder_name_is_refused(tmp_path):
    assert output_folder_problem(["hydra.run.dir="]) == (
        "error: hydra.run.dir='': names no folder; pick one for the run's outputs, e.g. hydra.run.dir=outputs/run1"
    )
    too_long = tmp_path / ("x" * 300)
    assert output_folder_problem([f"hydra.run.dir={too_long}"]) == (
        f"error: hydra.run.dir={too_long}: cannot create or write {too_long} (File name too long); "
        "pick another hydra.run.dir"
    )


def test_the_check_leaves_nothing_behind(tmp_path):
    target = tmp_path / "new" / "deeper"
    assert unwritable_folder(target) is None
    assert not (tmp_path / "new").exists()
    assert output_folder_problem([f"hydra.run.dir={target}"]) is None and not (tmp_path / "new").exists()
    existing = tmp_path / "there"
    existing.mkdir()
    assert unwritable_folder(existing) is None and list(existing.iterdir()) == []


@pytest.mark.slow  # python run.py: hydra imports (~2 s)
def test_run_py_on_an_uncreatable_folder_says_so_in_one_line():
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "hydra.run.dir=/proc/foo", "logger=none"],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        "error: hydra.run.dir=/proc/foo: cannot create or write /proc/foo (No such file or directory); "
        "pick another hydra.run.dir"
    )


class FullDisk:
    """A file object whose every write fails as on a full disk."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def write(self, data: object) -> int:
        raise FULL


def test_a_full_disk_under_events_jsonl_names_the_file(tmp_path, monkeypatch):
    events = EventLog(tmp_path / "events.jsonl", 0.0)
    events.write("crash", 1)
    monkeypatch.setattr(pathlib.Path, "open", FullDisk)
    with pytest.raises(OutputError) as failed:
        events.write("restart", 1)
    assert str(failed.value) == (
        f"could not write {tmp_path / 'events.jsonl'}: No space left on device; the records before are kept"
    )


def test_a_full_disk_under_the_launchers_other_records_names_each_file(tmp_path, monkeypatch):
    monkeypatch.setattr(pathlib.Path, "open", FullDisk)
    with pytest.raises(OutputError, match=r"could not write .*faults/group0: No space left on device"):
        request_fault(tmp_path / "faults" / "group0", "nan")
    with pytest.raises(OutputError, match=r"could not write .*notes\.jsonl: No space left on device"):
        append_text(tmp_path / "notes.jsonl", "{}\n")
    monkeypatch.undo()

    def full(self, *args, **kwargs):
        raise FULL

    paths = RunPaths(tmp_path / "run")
    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(OutputError, match=r"^could not write .*/job\.json: No space left on device$"):
        LocalCluster(compose_job(["logger=none"]), paths, "sig")
    monkeypatch.undo()

    class FullLock:
        def __init__(self, real) -> None:
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            self.real.close()

        def flush(self) -> None:
            raise FULL

    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: FullLock(real_open(*a, **k)))
    with (
        pytest.raises(OutputError, match=r"^could not write .*launcher\.lock: No space left on device$"),
        run_dir_claimed(paths),
    ):
        pass
