"""A checkpoint's save and load beside the disk's own throughput for the same bytes (bench_model_size).

The state is a DiLoCo worker's at a planned stop (``diloco.worker.state``): θ_l, AdamW's two
moments, θ_g and the outer momentum, fp32, 20 bytes a parameter. The bare figures write those
bytes to one file and read them back into new tensors, as ``load_rank`` does; the checkpoint's
are ``save_rank`` (one safetensors file hashed as it is written, flushed to disk, its manifest,
an atomic rename) and ``load_rank`` (the file hashed as it is read and checked against the
manifest). Each write is timed alone and again up to ``os.sync()`` returning: the bare write
leaves its bytes to the page cache, ``save_rank`` waits for the disk (``fsync``), so read its
figure beside the synced one. Reads follow their writes, so both come from the page cache.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from diloco.train.checkpoint import load_rank, save_rank
from diloco.train.tensor_file import tensor_bytes

KINDS = ("model", "inner.exp_avg", "inner.exp_avg_sq", "global", "outer.momentum")


def worker_state(shapes: list[torch.Size]) -> dict[str, torch.Tensor]:
    """A worker's checkpoint tensors of the model's shapes, one of each ``KINDS`` per parameter."""
    return {f"{kind}.{i}": torch.rand(shape) for kind in KINDS for i, shape in enumerate(shapes)}


def _timed(action, then_sync: bool = False) -> tuple[float, float]:
    """Milliseconds ``action`` took, and until ``os.sync()`` after it returned (or the same)."""
    start = time.perf_counter()
    action()
    done = time.perf_counter()
    if then_sync:
        os.sync()
    return 1e3 * (done - start), 1e3 * (time.perf_counter() - start)


def checkpoint_figures(shapes: list[torch.Size], folder: Path) -> dict[str, float]:
    """Raw write and read of the state's bytes, then ``save_rank`` and ``load_rank`` of it, in ms."""
    state = worker_state(shapes)
    folder.mkdir(parents=True, exist_ok=True)
    raw = folder / "raw.bin"

    def write_raw() -> None:
        with raw.open("wb") as file:
            for tensor in state.values():
                file.write(tensor_bytes(tensor))

    def read_raw() -> None:
        with raw.open("rb") as file:
            for tensor in state.values():
                file.readinto(tensor_bytes(torch.empty_like(tensor)))

    os.sync()  # what an earlier run left unwritten is not this one's to pay
    write_ms, write_synced_ms = _timed(write_raw, then_sync=True)
    read_ms, _ = _timed(read_raw)
    raw.unlink()
    rank = folder / "rank-0"
    save_ms, _ = _timed(lambda: save_rank(rank, state, {"step": 0}))
    load_ms, _ = _timed(lambda: load_rank(rank, state))
    shutil.rmtree(folder)
    return {
        "checkpoint_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "raw_write_ms": write_ms,
        "raw_write_synced_ms": write_synced_ms,
        "raw_read_ms": read_ms,
        "save_ms": save_ms,
        "load_ms": load_ms,
    }
