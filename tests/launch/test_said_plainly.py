"""Inputs that were once accepted silently or said vaguely, through ``python run.py``: each is
refused in one line naming the key or file and the fix, before any worker starts."""

from __future__ import annotations

import array
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.train.checkpoint import STATE, group_dir, mark_complete, rank_dir, save_rank, step_dir
from tests.conftest import REPO


def _run_py(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={out}", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def _refused_in_one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "weights_only" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.slow  # real python + hydra + torch starts (~3 s each)
def test_files_that_are_not_what_the_key_takes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"ok": True, "model_sha256": "0" * 64}))
    line = _refused_in_one_line(_run_py(tmp_path / "e1", "role=eval", f"checkpoint={run / 'summary.json'}"))
    assert line.startswith(f"error: checkpoint={run / 'summary.json'}: {run / 'summary.json'} is not a model file (")

    copied = tmp_path / "copied"  # a model.pt with its first byte flipped and no summary.json beside it
    copied.mkdir()
    torch.save({"w": torch.zeros(2)}, copied / "model.pt")
    buffer = bytearray((copied / "model.pt").read_bytes())
    buffer[0] ^= 0xFF
    (copied / "model.pt").write_bytes(buffer)
    line = _refused_in_one_line(_run_py(tmp_path / "e2", "role=sample", f"checkpoint={copied}"))
    assert line.startswith(f"error: checkpoint={copied}: {copied / 'model.pt'} is not a loadable model file")

    checkpoint = step_dir(tmp_path / "trained", 10)
    save_rank(rank_dir(group_dir(checkpoint, 0), 0), {"w": torch.zeros(2)}, {"step": 10})
    mark_complete(group_dir(checkpoint, 0), {"step": 10})
    shard = rank_dir(group_dir(checkpoint, 0), 0) / STATE
    line = _refused_in_one_line(_run_py(tmp_path / "r", f"trainer.resume={shard}", "logger=none"))
    assert line.endswith(f"a checkpoint is a folder, so pass trainer.resume={checkpoint}")

    tokens = tmp_path / "t32.bin"
    tokens.write_bytes(array.array("I", [(i * 7919) % 50_000 + 1 for i in range(4_000)]).tobytes())
    args = ["data=tokens", f"data.path={tokens}", "data.vocab_size=50001", "logger=none"]
    line = _refused_in_one_line(_run_py(tmp_path / "d", *args))
    assert line.startswith(f"error: {tokens}: every second token id") and "set data.token_dtype=uint32" in line
    for out in ("e1", "e2", "r", "d"):
        assert not (tmp_path / out / "logs").exists()  # no worker was started


@pytest.mark.slow  # a real python + hydra start (~3 s)
def test_a_lighthouse_whose_store_port_is_taken_names_the_key(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run_py(
            tmp_path, "role=lighthouse", "cluster.lighthouse.port=0", f"cluster.lighthouse.store_port={port}"
        )
    assert _refused_in_one_line(result) == (
        f"error: lighthouse cannot host its store on cluster.lighthouse.store_port={port} (address already in use); "
        "stop what listens there or pick another cluster.lighthouse.store_port (0 picks a free one)"
    )
