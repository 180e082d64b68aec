"""A checkpoint shard's file: safetensors' layout both ways, its sha256 taken as it passes, and a
truncated or foreign file refused (fast)."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco.train.tensor_file import TensorFileError, read_tensors, write_tensors

TENSORS = {
    "model.w": torch.arange(6.0).view(2, 3),
    "inner.0.step": torch.tensor(7.0),
    "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "none": torch.empty(0, 4),
    "mask": torch.tensor([True, False, True]),
    "ids": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_what_is_written_is_read_back_exactly_and_its_sha256_is_the_files(tmp_path):
    path = tmp_path / "state.safetensors"
    with path.open("wb") as file:
        written = write_tensors(file, TENSORS)
    assert written == hashlib.sha256(path.read_bytes()).hexdigest()
    with path.open("rb") as file:
        loaded, read = read_tensors(file)
    assert read == written and _equal(loaded, TENSORS)
    loaded["model.w"] += 1
    assert TENSORS["model.w"][0, 0] == 0, "new tensors, not views of the written ones"


def test_the_file_is_safetensors_both_ways(tmp_path):
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    with ours.open("wb") as file:
        write_tensors(file, TENSORS)
    with safe_open(str(ours), framework="pt") as opened:
        assert _equal({k: opened.get_tensor(k) for k in opened.keys()}, TENSORS)  # noqa: SIM118 - not a dict
    save_file(TENSORS, str(theirs))
    with theirs.open("rb") as file:
        assert _equal(read_tensors(file)[0], TENSORS)


def test_a_truncated_or_foreign_file_is_refused_saying_why():
    buffer = io.BytesIO()
    write_tensors(buffer, TENSORS)
    data = buffer.getvalue()
    for bad, why in [
        (data[:-3], "the file ends inside it"),
        (data + b"\0", "bytes after the last tensor"),
        (data[:5], "the file ends inside its header"),
        ((200 << 20).to_bytes(8, "little") + data[8:], "not a safetensors file"),
        (len(b"{nope").to_bytes(8, "little") + b"{nope", "its header is not JSON"),
        (data.replace(b'"F32"', b'"F99"', 1), "unknown dtype 'F99'"),
        (len(b"[1, 2]").to_bytes(8, "little") + b"[1, 2]", "not a safetensors header"),
        (data.replace(b'"data_offsets"', b'"data_offsetz"', 1), "not a safetensors header"),
    ]:
        with pytest.raises(TensorFileError, match=why):
            read_tensors(io.BytesIO(bad))
