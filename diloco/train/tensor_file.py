"""A worker's checkpoint tensors in one safetensors file, hashed as its bytes pass.

The format is safetensors' (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes), so a shard opens with
``safetensors.safe_open``; nothing in it is unpickled. Written and read here rather than with
``safetensors.torch`` because a checkpoint's cost is its bytes: each tensor goes between its own
memory and the file in one call, and the file's sha256 is taken on the way (the manifest's
record costs no second pass over the file). Reads go into new tensors, so a refused file leaves
nothing live touched.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from typing import IO, Any

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
ALIGN = 8  # the header is padded with spaces so the bytes after it start 8-aligned, as safetensors writes
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit: a larger length is a corrupt or foreign file


class TensorFileError(ValueError):
    """A file that is not a tensor file this module can read (truncated, foreign, or of unknown dtypes)."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (any dtype: a uint8 view of its flat values)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_tensors(file: IO[bytes], tensors: dict[str, torch.Tensor]) -> str:
    """Write ``tensors`` (CPU, contiguous) to ``file`` in safetensors' layout; the sha256 of what was written."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise TensorFileError(f"tensor {name}: dtype {tensor.dtype} has no safetensors name")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)
    digest = hashlib.sha256()
    for part in (struct.pack("<Q", len(text)), text, *(tensor_bytes(t) for t in tensors.values())):
        file.write(part)
        digest.update(part)
    return digest.hexdigest()


def read_layout(file: IO[bytes], digest: Any = None) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """The header of a file ``write_tensors`` wrote, checked: its tensors as (name, dtype, shape,
    first byte, end byte) in the order of their bytes, each range following the last and holding
    its shape. ``file`` is left at the first tensor's bytes; ``digest`` (a hashlib object) takes
    the header's bytes."""
    digest = digest if digest is not None else hashlib.sha256()
    prefix = _read_exactly(file, 8, digest)
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise TensorFileError(f"a header of {length} bytes: not a safetensors file")
    try:
        header = json.loads(_read_exactly(file, length, digest))
    except ValueError as error:
        raise TensorFileError(f"its header is not JSON ({error})") from None
    entries, position = _entries(header), 0
    for name, dtype, shape, begin, end in entries:
        if begin != position or end < begin:
            raise TensorFileError(f"tensor {name}: bytes {begin}..{end} do not follow the previous tensor's")
        if end - begin != dtype.itemsize * math.prod(shape):
            raise TensorFileError(f"tensor {name}: {end - begin} bytes do not hold shape {shape} of {dtype}")
        position = end
    return entries


def read_tensors(file: IO[bytes]) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of a file ``write_tensors`` wrote, as new CPU tensors, and the sha256 of the file's bytes."""
    digest = hashlib.sha256()
    tensors = {}
    for name, dtype, shape, begin, end in read_layout(file, digest):
        flat = torch.empty(end - begin, dtype=torch.uint8)
        view = memoryview(flat.numpy())
        if file.readinto(view) != len(view):
            raise TensorFileError(f"tensor {name}: the file ends inside it")
        digest.update(view)
        tensors[name] = flat.view(dtype).reshape(shape)
    if file.read(1):
        raise TensorFileError("bytes after the last tensor")
    return tensors, digest.hexdigest()


def _entries(header: Any) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """The header's tensors as (name, dtype, shape, first byte, end byte), in the order of their bytes."""
    try:
        entries = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = BY_NAME.get(entry["dtype"])
            if dtype is None:
                raise TensorFileError(f"tensor {name}: unknown dtype {entry['dtype']!r}")
            shape, (begin, end) = [int(n) for n in entry["shape"]], entry["data_offsets"]
            entries.append((name, dtype, shape, int(begin), int(end)))
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise TensorFileError(f"its header is not a safetensors header ({error!r})") from None
    return sorted(entries, key=lambda entry: entry[3])


def _read_exactly(file: IO[bytes], size: int, digest: Any) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise TensorFileError("the file ends inside its header")
    digest.update(data)
    return data
