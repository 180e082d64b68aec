"""Which device a worker trains on: ``cluster.device`` against what torch sees."""

from __future__ import annotations

import torch

from diloco.config.base import check


def check_device(preference: str) -> None:
    """Refuse ``cluster.device=cuda`` where torch sees no GPU, before any process starts."""
    check(
        preference != "cuda" or torch.cuda.is_available(),
        "cluster.device",
        preference,
        "torch sees no CUDA device on this machine; use cluster.device=cpu (or auto)",
    )


def select_device(preference: str, local_rank: int) -> torch.device:
    """``auto`` takes this worker's GPU when there is one, else the CPU."""
    check_device(preference)
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
