"""Zero-copy bytes of a CPU tensor, for checksums and digests without numpy."""

from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-D CPU uint8 tensor (torch has no buffer protocol of its own).

    The view borrows the tensor's memory: keep the tensor alive while the view is used.
    """
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1:
        raise ValueError(f"expected a contiguous 1-D CPU uint8 tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B")


def as_bytes_tensor(t: torch.Tensor) -> torch.Tensor:
    """Any tensor's raw bytes as a contiguous 1-D CPU uint8 tensor (bfloat16 and 0-d included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
