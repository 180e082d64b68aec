"""Muon's Newton–Schulz work spread over a mesh's workers equals running it on one worker, bit for bit.

Two real Gloo processes hold every matrix sharded, on a 1-D mesh (FSDP2's: the mesh's own group)
and on a 1 x 2 mesh (dp x tp: the default group spans it). Five matrices make three turns of two,
the last one short, so each worker orthogonalizes its own matrices and broadcasts them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diloco.exits import exit_without_teardown
from diloco.train.muon import Muon

pytestmark = pytest.mark.slow  # two processes with a Gloo group (~5 s)

SHAPES = [(8, 12), (12, 8), (6, 6), (16, 4), (4, 10)]
SETTINGS = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "ns_steps": 5, "betas": (0.9, 0.95), "eps": 1e-8}


def matrices() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The starting weights and two steps' gradients, the same in every process."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=g) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=g) for shape in SHAPES] for _ in range(2)]
    return weights, grads


def stepped(make: callable, spread: bool) -> list[torch.Tensor]:
    """The weights after two Muon steps, each parameter made by ``make`` from its full tensor."""
    weights, grads = matrices()
    params = [torch.nn.Parameter(make(w)) for w in weights]
    optimizer = Muon([{"params": params, "muon": True}], spread=spread, **SETTINGS)
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = make(grad)
        optimizer.step()
    return [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]


def _worker(rank: int, init: str, out: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        results = {}
        for name, shape, placements in (
            ("fsdp", (2,), [Shard(0)]),
            ("dp_tp", (1, 2), [Replicate(), Shard(1)]),
        ):
            mesh = init_device_mesh("cpu", shape)
            for spread in (True, False):
                results[f"{name}-{spread}"] = stepped(lambda t: distribute_tensor(t, mesh, placements), spread)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
    # As a worker ends: Gloo's C++ teardown at interpreter exit can end in std::terminate.
    exit_without_teardown()


def test_spread_newton_schulz_equals_one_worker_bit_for_bit(tmp_path):
    out = tmp_path / "results.pt"
    mp.start_processes(_worker, args=(f"file://{tmp_path / 'store'}", out), nprocs=2, start_method="spawn")
    results = torch.load(out)
    alone = stepped(lambda t: t.clone(), spread=True)
    for name, weights in results.items():
        assert all(torch.equal(a, b) for a, b in zip(weights, alone, strict=True)), name
