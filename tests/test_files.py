"""Result files are written whole or not at all."""

from __future__ import annotations

import errno
import json

import pytest

from diloco.files import OutputError, write_atomically, write_json_atomically


def test_a_write_that_fails_halfway_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"previous model")

    def full_disk(fh) -> None:
        fh.write(b"half of the new mod")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match=r"could not write .*model.pt: No space left on device; the previous"):
        write_atomically(path, full_disk)
    assert path.read_bytes() == b"previous model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no temporary left behind


def test_a_first_write_that_fails_leaves_nothing(tmp_path):
    def fails(fh) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OutputError, match="no previous version exists"):
        write_atomically(tmp_path / "out" / "summary.json", fails)
    assert list((tmp_path / "out").iterdir()) == []


def test_json_is_replaced_in_one_step(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomically(path, {"ok": False})
    write_json_atomically(path, {"ok": True})
    assert json.loads(path.read_text()) == {"ok": True}
