"""Time one inner step (forward, backward, AdamW) of each model preset on CPU.

Answers "which preset can a laptop or CI run?" and catches speed regressions in the model:

    python -m experiments.parallelism.bench_model            # tiny and small
    python -m experiments.parallelism.bench_model --all      # every preset in conf/model
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from diloco.config.base import from_dict
from diloco.config.model import ModelConfig
from diloco.train.model import Transformer, count_parameters, meta_model

REPO = Path(__file__).resolve().parents[2]
CPU_PRESETS = ("tiny", "small")


def step_times_ms(cfg: ModelConfig, batch: int, seq: int, warmup: int, steps: int) -> list[float]:
    """Wall time of each timed inner step, after ``warmup`` untimed ones."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(cfg.vocab_size, (batch, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--all", action="store_true", help="also the presets too big for a quick CPU run")
    args = parser.parse_args()

    presets = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    if not args.all:
        presets = [p for p in presets if p in CPU_PRESETS]
    print(f"batch {args.batch} x seq {args.seq}, {torch.get_num_threads()} threads, median of {args.steps} steps\n")
    print("| preset | parameters | median step ms | tokens/s |")
    print("|---|---:|---:|---:|")
    rows = []
    for name in presets:
        cfg = from_dict(ModelConfig, yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text()), "model")
        rows.append((count_parameters(meta_model(cfg)), name, cfg))  # to order the table by size
    for n_params, name, cfg in sorted(rows):
        median = statistics.median(step_times_ms(cfg, args.batch, args.seq, args.warmup, args.steps))
        tokens_per_s = args.batch * args.seq / (median / 1e3)
        print(f"| {name} | {n_params / 1e6:.2f}M | {median:.1f} | {tokens_per_s:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
