"""A training loop of one's own, FSDP2 inside each replica group, Streaming DiLoCo between groups.

    python -m diloco.launch.script_groups --groups 2 --workers-per-group 2 --run-dir runs/fsdp \\
        experiments/fault_tolerance/own_loop_fsdp.py [--steps 40] [--sync-every 10] [--save 'final{group}.pt']

Each group is one torchrun job of N workers: they join the group's process group (Gloo on CPU,
NCCL on CUDA), build the same initial model from one seed, shard it with FSDP2 over a device
mesh of the group (``fully_shard`` each block, then the root; a group of one worker stays whole)
and build AdamW over the shards. ``DiLoCo`` then syncs each worker's shard with the same shard of
the other groups every H steps.

The data is a synthetic corpus the model can learn (arithmetic progressions mod the vocabulary),
one batch per (group, step): each worker trains on its own slice of its group's batch, so the
group trains on the same tokens whatever its number of workers, and a group that heals from a
peer (``outer.step`` jumps) reads the batches at the job's step. ``--save`` writes the job's
final model as one full (unsharded) state dict from rank 0, to compare runs with different N.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from diloco import DiLoCo, init_group
from diloco.config.model import ModelConfig
from diloco.train.model import Transformer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="inner steps of the job (max_steps)")
    parser.add_argument("--sync-every", type=int, default=10, help="H: inner steps between a fragment's syncs")
    parser.add_argument("--batch", type=int, default=8, help="sequences per group and step (split over its workers)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="the initial model's seed (the same in every group)")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if every worker has a GPU"
    )
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument(
        "--save", default="", help="write the final full state dict here (rank 0; '{group}' becomes the group)"
    )
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """This project's Llama-style model, tiny by default (``--dim``, ``--layers``): a run takes seconds on a CPU."""
    return ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=2, n_kv_heads=2, vocab_size=64, ffn_hidden_dim=2 * args.dim
    )


def synthetic_batch(group: int, step: int, args: argparse.Namespace, vocab: int) -> torch.Tensor:
    """The group's batch at ``step``: [batch, seq + 1] tokens, each row start + stride·t mod vocab.

    Seeded by (seed, group, step) only, never by rank, so 1 or N workers see the same group batch.
    """
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + group * 100_003 + step)
    start = torch.randint(0, vocab, (args.batch, 1), generator=gen)
    stride = torch.randint(1, 4, (args.batch, 1), generator=gen)
    return (start + stride * torch.arange(args.seq + 1)) % vocab


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    group = int(os.environ.get("DILOCO_GROUP", "0"))
    # NCCL needs a GPU of its own per worker of the group (LOCAL_WORLD_SIZE: torchrun's workers here).
    enough_gpus = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda = args.device == "cuda" or (args.device == "auto" and enough_gpus)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # The group's own training process group; DiLoCo makes a separate Gloo group beside it for
    # its rounds, which run on another thread.
    init_group("nccl" if cuda else "gloo")  # restart-safe under torchrun (a prefix per restart)
    rank, workers = dist.get_rank(), dist.get_world_size()
    if args.batch % workers:
        raise SystemExit(f"--batch {args.batch} must split evenly over the group's {workers} workers")

    # One seed everywhere: every worker of every group starts from the same θ, as DiLoCo requires.
    torch.manual_seed(args.seed)
    config = model_config(args)
    model = Transformer(config).to(device)
    if workers > 1:
        # FSDP2: each block is its own unit (gathered for its forward, freed after), the root
        # holds what is left (embeddings, final norm, output). Parameters become DTensors, each
        # worker holding a dim-0 shard; DiLoCo syncs those shards, each with its peers' same shard.
        mesh = init_device_mesh(device.type, (workers,), mesh_dim_names=("shard",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # Built after sharding, over the DTensor parameters: DiLoCo checks it updates every one.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    rows = args.batch // workers
    with DiLoCo(
        model, optimizer, max_steps=args.steps, algo="streaming", sync_every=args.sync_every, fragments=2, delay=1
    ) as outer:
        while not outer.done:
            step = outer.step  # may have jumped forward: a late group healed from a peer
            tokens = synthetic_batch(group, step, args, config.vocab_size)
            mine = tokens[rank * rows : (rank + 1) * rows].to(device)
            logits = model(mine[:, :-1])
            # The mean over this worker's slice; FSDP2 averages gradients over the group's
            # workers, so the group steps on the mean over its whole batch whatever N is.
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            # The group's tokens, the same on every rank (what algo.weighting=tokens would weigh).
            metrics = outer.after_inner_step(tokens=args.batch * args.seq)
            if outer.step % args.log_every == 0 or outer.done:  # the same steps on every rank
                group_loss = loss.detach().clone()
                dist.all_reduce(group_loss)  # on the training group, from the training thread
                if rank == 0:
                    synced = " (outer round applied)" if metrics else ""
                    print(f"group {group} step {outer.step} loss {group_loss.item() / workers:.4f}{synced}", flush=True)

    # The model now holds the job's final global model, sharded as before: gather it on rank 0.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result = outer.result
    if rank == 0:
        if args.save:  # written whole or not at all: a reader never sees half a file
            path = args.save.format(group=group)
            torch.save(full, f"{path}.partial")
            os.replace(f"{path}.partial", path)
        print(
            f"group {group} done: digest {result.digest} rounds {result.rounds} "
            f"holds_final_model {result.holds_final_model}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
