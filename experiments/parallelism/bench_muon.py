"""Muon's optimizer step on FSDP2-sharded matrices: Newton–Schulz on every worker against spread over them.

Every worker of a group holds a shard of each hidden matrix (FSDP2's ``Shard(0)``); Muon needs each
matrix whole. Run everywhere, each of W workers gathers every u and orthogonalizes every matrix;
spread (``inner_opt=muon``'s way), worker k orthogonalizes the k-th matrix of each turn of W and
broadcasts O. Both give the same bits (tests/train/test_muon_spread.py); this times them side by
side, in one run, on real Gloo processes with one thread each:

    python -m experiments.parallelism.bench_muon                       # model=small, 2 workers
    python -m experiments.parallelism.bench_muon --model llama3_150m --workers 4 --steps 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from diloco.config.base import from_dict
from diloco.config.model import ModelConfig
from diloco.train.model import meta_model
from diloco.train.muon import Muon, hidden_matrices
from experiments.common import markdown_table, median, write_result

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {"lr": 0.005, "weight_decay": 0.1, "momentum": 0.95, "ns_steps": 5, "betas": (0.9, 0.95), "eps": 1e-8}


def matrix_shapes(preset: str) -> list[tuple[int, ...]]:
    cfg = from_dict(ModelConfig, yaml.safe_load((REPO / "conf" / "model" / f"{preset}.yaml").read_text()), "model")
    return [tuple(p.shape) for p in hidden_matrices(meta_model(cfg))]


def step_ms(shapes: list[tuple[int, ...]], make: callable, spread: bool, warmup: int, steps: int) -> list[float]:
    """Wall time of each timed ``Muon.step`` (every worker starts it together), after ``warmup`` untimed ones."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(make(torch.randn(shape, generator=g) * 0.02)) for shape in shapes]
    for p, shape in zip(params, shapes):
        p.grad = make(torch.randn(shape, generator=g))
    optimizer = Muon([{"params": params, "muon": True}], spread=spread, **SETTINGS)
    times = []
    for i in range(warmup + steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        if dist.is_initialized():
            dist.barrier()
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - start))
    return times


def _worker(rank: int, workers: int, init: str, shapes: list, warmup: int, steps: int, out: Path) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=workers)
    try:
        mesh = init_device_mesh("cpu", (workers,))
        shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
        times = {spread: step_ms(shapes, shard, spread, warmup, steps) for spread in (False, True)}
        if rank == 0:
            torch.save(times, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="conf/model preset whose hidden matrices are stepped")
    parser.add_argument("--workers", type=int, default=2, help="workers of the group (processes, one thread each)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--results", default=None, help="folder of the results (default experiments/results)")
    args = parser.parse_args()

    shapes = matrix_shapes(args.model)
    torch.set_num_threads(1)
    alone = median(step_ms(shapes, lambda t: t, True, args.warmup, args.steps))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.pt"
        init = f"file://{Path(tmp) / 'store'}"
        worker_args = (args.workers, init, shapes, args.warmup, args.steps, out)
        mp.start_processes(_worker, args=worker_args, nprocs=args.workers, start_method="spawn")
        times = torch.load(out)
    everywhere, spread = median(times[False]), median(times[True])
    numel = sum(a * b for a, b in shapes)
    rows = [
        ["1 worker, whole matrices", f"{alone:.0f}", "-"],
        [f"FSDP2 x {args.workers}, every worker runs every matrix", f"{everywhere:.0f}", "1.00"],
        [f"FSDP2 x {args.workers}, spread over the workers", f"{spread:.0f}", f"{everywhere / spread:.2f}"],
    ]
    text = (
        f"Muon step of model={args.model}'s {len(shapes)} hidden matrices ({numel / 1e6:.1f}M values), "
        f"median of {args.steps} steps, one thread per worker\n\n"
        + markdown_table(["layout", "ms per step", "speed-up"], rows)
    )
    print(text)
    print(f"\nwritten to {write_result('bench_muon.md', text, args.results)}")


if __name__ == "__main__":
    main()
