"""A training loop of one's own under fault-tolerant Streaming DiLoCo: a Hugging Face Llama, plain PyTorch.

Nothing here is the project's trainer: the model is ``transformers.LlamaForCausalLM`` (random init
from a ``LlamaConfig``, nothing downloaded), the inner optimizer a plain AdamW, the data random
windows of a token file ``role=prepare`` wrote. ``DiLoCo`` (``from diloco import DiLoCo, init_group``) is the
only part of the project in the loop: every ``--sync-every`` inner steps the groups average each
fragment's pseudo-gradient through the job's lighthouse, and a group that restarts takes the live
state from a peer and jumps to the job's step.

    python run.py role=prepare prepare.input=TEXT_DIR prepare.output=corpus prepare.vocab_size=512
    python -m diloco.launch.script_groups --groups 2 --max-restarts 1 --run-dir runs/own \\
        experiments/fault_tolerance/own_loop.py --data corpus/tokens.bin --steps 200

The launcher starts the lighthouse and one ``torchrun`` per group, with DILOCO_LIGHTHOUSE,
DILOCO_GROUP, DILOCO_JOB, DILOCO_RUN_DIR and DILOCO_LIGHTHOUSE_TOKEN set for ``DiLoCo`` to read;
with ``--workers-per-group N`` a group's N workers train data-parallel (DDP over Gloo).
Each group prints its loss every ``--log-every`` steps and, at the end, the held-out loss of the
job's final global model, its digest and whether this group holds it.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from diloco import DiLoCo, init_group, refuse
from diloco.config.base import ConfigError
from diloco.config.tokens_meta import metadata_path, read_meta_file

EVAL_SEED = 12345  # the held-out windows: the same in every group, so their losses compare


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="the tokens.bin role=prepare wrote (tokens.json beside it)")
    p.add_argument("--steps", type=int, default=100, help="inner steps of the job (a multiple of --sync-every)")
    p.add_argument("--sync-every", type=int, default=10, help="H: inner steps between a fragment's rounds")
    p.add_argument("--fragments", type=int, default=2, help="P: Streaming DiLoCo's fragments (<= --layers)")
    p.add_argument("--delay", type=int, default=1, help="τ: inner steps a fragment's all-reduce overlaps")
    p.add_argument("--quantize", default="fp4", help="the pseudo-gradient's wire format: none, bf16, fp8, fp4")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="windows per inner step and worker")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--val-fraction", type=float, default=0.1, help="the file's tail held out for the final loss")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="the model's init: must be the same in every group")
    return p.parse_args()


def load_tokens(path: str) -> tuple[np.ndarray, int]:
    """The token file as a read-only memory map (every worker shares the page cache, nothing is
    copied), and the vocabulary size its metadata records: the tokenizer's, not a guess."""
    if not os.path.isfile(path):  # refused, not raised: torchrun would start the group again to meet it again
        refuse(
            f"--data {path}: no such token file; prepare a corpus first (python run.py role=prepare "
            "prepare.input=TEXT_DIR prepare.output=corpus) and pass --data corpus/tokens.bin"
        )
    try:
        meta = read_meta_file(metadata_path(path))
    except ConfigError as error:
        refuse(str(error))
    tokens = np.memmap(path, dtype=meta.token_dtype, mode="r")
    if tokens.size != meta.tokens:
        refuse(f"{path}: {tokens.size} tokens, its metadata counts {meta.tokens}; run role=prepare again")
    return tokens, meta.tokenizer.vocab_size


def windows(tokens: np.ndarray, rng: np.random.Generator, count: int, seq_len: int) -> torch.Tensor:
    """``count`` random windows of ``seq_len + 1`` tokens (inputs and their next tokens)."""
    starts = rng.integers(0, tokens.size - seq_len - 1, size=count)
    return torch.from_numpy(np.stack([tokens[s : s + seq_len + 1].astype(np.int64) for s in starts]))


def batch_at(train: np.ndarray, args: argparse.Namespace, group: int, rank: int, step: int) -> torch.Tensor:
    """Step ``step``'s batch, a function of (group, rank, step) alone: a group that heals and jumps to
    the job's step reads the windows it would have read had it never stopped, and groups differ."""
    rng = np.random.default_rng([args.seed, group, rank, step])
    return windows(train, rng, args.batch, args.seq_len)


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: the model shifts ``labels`` by one itself."""
    return model(input_ids=batch, labels=batch).loss


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, val: np.ndarray, args: argparse.Namespace) -> float:
    rng = np.random.default_rng(EVAL_SEED)
    model.eval()
    losses = [loss_of(model, windows(val, rng, args.batch, args.seq_len)).item() for _ in range(args.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # many small processes on few cores: threads would only contend
    group = int(os.environ.get("DILOCO_GROUP", "0"))
    tokens, vocab_size = load_tokens(args.data)  # before anything joins: a missing corpus costs nothing
    # torchrun's workers of one group train data-parallel (DDP over gloo); DiLoCo syncs between groups.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        init_group("gloo")  # restart-safe under torchrun (a prefix per restart)
    rank = dist.get_rank() if dist.is_initialized() else 0

    n_val = int(tokens.size * args.val_fraction)
    train, val = tokens[: tokens.size - n_val], tokens[tokens.size - n_val :]

    # Every group must start from the same θ (DiLoCo averages θ_g - θ_l element by element; the
    # lighthouse refuses a group whose starting weights differ): the init is seeded alike everywhere.
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,  # the blocks (model.layers.<i>) that Streaming DiLoCo splits into fragments
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    trained = DistributedDataParallel(model) if world_size > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    first = True
    with DiLoCo(
        model,  # the bare model: DiLoCo copies and updates its parameters, which DDP shares
        opt,
        max_steps=args.steps,
        algo="streaming",
        sync_every=args.sync_every,
        fragments=args.fragments,
        delay=args.delay,
        quantize=args.quantize,
    ) as outer:
        if rank == 0 and outer.step > 0:  # joined late or restarted: θ, optimizers and step came from a peer
            print(f"group {group} healed from a peer: resuming at step {outer.step}", flush=True)
        while not outer.done:
            batch = batch_at(train, args, group, rank, outer.step)  # outer.step: the job's clock after a heal
            loss = loss_of(trained, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            metrics = outer.after_inner_step(tokens=batch[:, 1:].numel())
            if rank == 0 and (first or outer.step % args.log_every == 0 or metrics):
                synced = " (outer round)" if metrics else ""
                print(f"group {group} step {outer.step} loss {loss.item():.4f}{synced}", flush=True)
            first = False

    # Leaving the block waited for every group; the model now holds the job's final global model.
    result = outer.result
    if rank == 0:
        print(f"group {group} held-out loss {held_out_loss(model, val, args):.4f}", flush=True)
        print(
            f"group {group} digest {result.digest} rounds {result.rounds} holds_final_model {result.holds_final_model}",
            flush=True,
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
