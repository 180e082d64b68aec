"""How much of a round's pseudo-gradient does SparseLoCo's top-k keep, with each inner optimizer?

The sparse recipe with Muon inside trails dense DiLoCo with Muon by far more than with AdamW
(docs/results/outer-recipe.md). A guess: Muon's orthogonalized steps spread each matrix's update
evenly over its entries, so a chunk's top 1% carries less of it. This measures it on one group
training alone (no outer step, as ``algo=local``), the ``compare_ddp`` preset's model and
batches: every H inner steps Δ = θ_then − θ_now, and with the error feedback of a topk job

    a = β·e + Δ        ŝ = top-k of a, chunk by chunk        e ← a − ŝ

it records the share of ‖a‖² that ŝ keeps (32-bit values: only the selection is measured) and,
for Δ alone, the share its own top-k keeps. The mean share over each stretch of the run is
printed per inner optimizer.

    python -m experiments.outer_recipe.topk_share --steps 1000 --inner adamw muon
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from diloco.outer.sparse import TopK
from diloco.train.model import Transformer
from diloco.worker.builders import build_trainer
from experiments.common import compose_job, markdown_table, write_result

EXPERIMENT = "compare_ddp"


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float()


def share(kept: torch.Tensor, x: torch.Tensor) -> float:
    """‖kept‖² / ‖x‖²."""
    return float(kept.square().sum() / x.square().sum().clamp_min(1e-30))


def kept_share(codec: TopK, x: torch.Tensor) -> float:
    """The share of ‖x‖² its top-k keeps, chunk by chunk as the topk codec selects."""
    return share(codec.decode(codec.encode(x), x.numel()), x)


def measure(inner: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """Train one group ``args.steps`` inner steps with ``inner``; one record per window of H steps."""
    job = compose_job(
        ["algo=local", f"model={args.model}", f"trainer.max_steps={args.steps}", f"inner_opt={inner}"]
        + [f"trainer.seed={args.seed}"],
        EXPERIMENT,
    )
    torch.manual_seed(job.trainer.seed)
    model = Transformer(job.model)
    trainer = build_trainer(job, model, group=0, worker=0, num_workers=1, device=torch.device("cpu"))
    codec = TopK(args.density, value_bits=32)
    start, error, records = flat(model), None, []
    for step in range(1, args.steps + 1):
        trainer.train_step()  # the job's own inner step: micro-batches, clipping, the lr schedule
        if step % args.h == 0:
            now = flat(model)
            delta = start - now
            a = delta if error is None else args.beta * error + delta
            sent = codec.decode(codec.encode(a), a.numel())
            error = a - sent
            records.append(
                {
                    "step": step,
                    "delta": kept_share(codec, delta),
                    "with_error": share(sent, a),
                }
            )
            start = now
    return records


def stretches(records: list[dict[str, float]], steps: int) -> list[tuple[int, int]]:
    """Five equal stretches of the run (each at least one window)."""
    edges = [round(steps * i / 5) for i in range(6)]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if any(lo < r["step"] <= hi for r in records)]


def table(found: dict[str, list[dict[str, float]]], steps: int) -> str:
    spans = stretches(next(iter(found.values())), steps)
    body = []
    for inner, records in found.items():
        for key, what in (("delta", "Δ"), ("with_error", "β·e + Δ")):
            cells = []
            for lo, hi in spans:
                values = [r[key] for r in records if lo < r["step"] <= hi]
                cells.append(f"{100 * sum(values) / len(values):.1f}%")
            body.append([inner, what, *cells])
    return markdown_table(["inner", "of", *(f"steps {lo + 1}-{hi}" for lo, hi in spans)], body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", nargs="+", default=["adamw", "muon"], help="conf/inner_opt presets")
    parser.add_argument("--model", default="mini", help="conf/model preset")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps, a multiple of H")
    parser.add_argument("--h", type=int, default=20, help="inner steps per round (the sparse recipe's H)")
    parser.add_argument("--density", type=float, default=0.01, help="share of each 4,096-entry chunk kept")
    parser.add_argument("--beta", type=float, default=0.95, help="the error feedback's decay β")
    parser.add_argument("--seed", type=int, default=1, help="trainer.seed")
    parser.add_argument("--results", metavar="DIR", help="folder of the results (default experiments/results)")
    args = parser.parse_args(argv)
    if args.steps < args.h or args.steps % args.h:
        parser.error(f"--steps={args.steps}: must be a positive multiple of --h={args.h}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.monotonic()
    found = {inner: measure(inner, args) for inner in args.inner}
    setup = (
        f"model={args.model}, one group, {args.steps} inner steps, top {100 * args.density:g}% of each chunk "
        f"every {args.h} steps, β={args.beta}, trainer.seed {args.seed}: the share of ‖x‖² kept"
    )
    text = "\n".join([setup, "", table(found, args.steps)])
    print(text)
    write_result("topk_share.md", text, args.results)
    write_result("topk_share.json", json.dumps(found, indent=2), args.results)
    print(f"total wall time {(time.monotonic() - began) / 60:.1f} min")


if __name__ == "__main__":
    main()
