"""The CUDA path on one GPU: NCCL inside each group, Gloo lanes between groups, bf16, θ_g pinned on the CPU.

Each check is a real job, composed from ``conf/`` and launched as ``python run.py`` launches it:

- smoke: 2 groups x 1 worker of ``tiny`` sharing the GPU (NCCL refuses two ranks of one
  communicator on one GPU, so a group has one worker per GPU here), DCP checkpoints, then a
  resume from them: both jobs end ok with equal digests.
- speed: inner steps of a one-group ``llama3_150m`` job (bf16 autocast) against a plain
  training loop of the same model, batch, AdamW and clipping in this process, written as a
  user would write it (target: the job at least 95% of the plain loop's tokens/s).
- sync: 2 groups of ``llama3_150m``: one outer sync of the whole model over the Gloo lane,
  fp32 and fp4, against an inner step (both groups share the GPU, so their inner steps contend).
- digest: sha256 of the 150M model's θ_g and outer momentum, the most a commit hashes.
- faults: 3 groups of ``tiny``, a random group SIGKILLed every 8 s and one SIGSTOPped for 4 s
  every 13 s: the job ends ok, every kill recovered, equal digests.
- hf: a random ``LlamaForCausalLM`` of Llama 3.2 1B's config (128,256-token vocabulary, GQA,
  llama3 RoPE scaling, tied embeddings; bf16 as Meta ships it) saved by transformers, imported
  (``model.init_from``: this model's logits against transformers' on the GPU, fp32), 2 groups
  of DiLoCo from it, then ``role=export`` and transformers' logits of the export against the
  job's model.pt. Needs transformers.

    python -m experiments.gpu.gpu_check                      # every check (about 8 min on one H100)
    python -m experiments.gpu.gpu_check --only speed sync    # some of them
    python -m experiments.gpu.gpu_check --cpu-dry-run        # the same checks on the CPU at toy sizes

Prints a markdown table and writes it to experiments/results/gpu_check.md (and --out DIR).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from diloco.config.job import JobConfig, job_config_from_dict
from diloco.launch.compose import compose_raw
from diloco.outer.digest import state_digest
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from diloco.train.model import Transformer, count_parameters
from experiments.common import markdown_table, run_job, runs_root, stop_on_sigterm, verdict, write_result

CHECKS = ("smoke", "speed", "sync", "digest", "faults", "hf")
SPEED_TARGET = 0.95
HF_LOGITS_TOLERANCE = 1e-3  # fp32 on the GPU, 16 blocks: cuBLAS sums in another order than transformers' kernels
# Llama 3.2 1B's config.json (its shape; the weights here are random: nothing is downloaded).
LLAMA32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
)
TOY_LLAMA = LLAMA32_1B | dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_scaling=LLAMA32_1B["rope_scaling"] | {"original_max_position_embeddings": 128},
    bos_token_id=510,
    eos_token_id=511,
)


@dataclass(frozen=True)
class Shape:
    """Sizes of one pass: the GPU's, or toy ones for a dry run on the CPU."""

    device: str
    big_model: str
    batch: int
    seq: int
    speed_steps: int
    sync_every: int
    fault_seconds: float
    hf_config: dict[str, Any]


GPU = Shape("cuda", "llama3_150m", 16, 1024, speed_steps=200, sync_every=20, fault_seconds=60.0, hf_config=LLAMA32_1B)
CPU_DRY = Shape("cpu", "tiny", 4, 64, speed_steps=60, sync_every=10, fault_seconds=30.0, hf_config=TOY_LLAMA)


def compose(shape: Shape, overrides: list[str]) -> JobConfig:
    base = ["logger=none", f"cluster.device={shape.device}", "cluster.workers_per_group=1", "trainer.eval_batches=2"]
    base.append("algo.sync_warmup_steps=0")  # every window H long: the speed and fault rows time H's rounds
    return job_config_from_dict(compose_raw(base + overrides))


def equal_digests(summary: dict[str, Any]) -> bool:
    digests = {g.get("digest") for g in summary.get("per_group", [])}
    return len(digests) == 1 and None not in digests


def inner_tokens_per_s(run_dir: Path, group: int = 0) -> list[float]:
    """The job's tokens/s per log window, leaving out windows with an outer sync or the first two."""
    records = read_jsonl(RunPaths(run_dir).metrics(group))
    windows = [r for r in records if "train/tokens_per_s" in r]
    return [r["train/tokens_per_s"] for r in windows[2:] if "outer/sync_ms" not in r and "eval/loss" not in r]


def metric_values(run_dir: Path, key: str, group: int = 0) -> list[float]:
    return [r[key] for r in read_jsonl(RunPaths(run_dir).metrics(group)) if key in r]


def check_smoke(shape: Shape, root: Path) -> dict[str, Any]:
    common = ["model=tiny", "cluster.groups=2", f"algo.sync_every={shape.sync_every}"]
    every = f"trainer.checkpoint.every={5 * shape.sync_every}"
    first = compose(shape, common + [f"trainer.max_steps={10 * shape.sync_every}", every])
    run = root / "smoke"
    summary = run_job(first, run, keep_failure=True)
    resumed_dir = root / "smoke_resumed"
    resumed = run_job(
        compose(shape, common + [f"trainer.max_steps={15 * shape.sync_every}", f"trainer.resume={run}"]),
        resumed_dir,
        keep_failure=True,
    )
    step_ms = statistics.median(metric_values(run, "train/step_ms") or [float("nan")])
    ok = bool(summary.get("ok") and resumed.get("ok") and equal_digests(summary) and equal_digests(resumed))
    return {
        "ok": ok,
        "eval_loss": summary.get("final_eval_loss"),
        "resumed_eval_loss": resumed.get("final_eval_loss"),
        "rounds": summary.get("rounds"),
        "resumed_rounds": resumed.get("rounds"),
        "step_ms": step_ms,
        "failure": summary.get("failure") or resumed.get("failure"),
    }


def plain_loop_tokens_per_s(job: JobConfig, steps: int, window: int = 10) -> list[float]:
    """The loop a user writes for one GPU: the same model, AdamW, clipping and bf16 autocast."""
    device = torch.device(job.cluster.device if job.cluster.device != "auto" else "cuda")
    torch.manual_seed(0)
    model = Transformer(job.model).to(device)
    opt = job.inner_opt
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=0.1)
    batch, seq = job.trainer.batch_size, job.trainer.seq_len
    data = torch.randint(job.model.vocab_size, (steps, batch, seq + 1))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    rates, started = [], time.perf_counter()
    for step in range(steps):
        tokens = data[step].to(device, non_blocking=True)
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % window == 0:
            loss.item()  # waits for the GPU, as a user's logging does once per window
            now = time.perf_counter()
            rates.append(batch * seq * window / (now - started))
            started = now
    return rates[2:]


SPEED_VARIANTS = {
    "eager": [],
    "compile, selective AC": ["trainer.compile=true", "trainer.activation_checkpoint=selective"],
}


def check_speed(shape: Shape, root: Path, rows: list[str]) -> dict[str, Any]:
    """The plain loop against the job as it comes, then the job's other inner-loop options."""
    result: dict[str, Any] = {"ok": True}
    for label in rows:
        options = SPEED_VARIANTS[label]
        job = compose(
            shape,
            [
                f"model={shape.big_model}",
                "cluster.groups=1",
                f"trainer.batch_size={shape.batch}",
                f"trainer.seq_len={shape.seq}",
                f"trainer.max_steps={shape.speed_steps}",
                "trainer.eval_every=0",
                f"algo.sync_every={shape.speed_steps // 2}",
                *options,
            ],
        )
        run = root / f"speed_{len(result)}"
        summary = run_job(job, run, keep_failure=True)
        result[label] = {
            "ok": bool(summary.get("ok")),
            "tokens_per_s": statistics.median(inner_tokens_per_s(run) or [float("nan")]),
            "tflops": statistics.median(metric_values(run, "train/tflops")[2:] or [float("nan")]),
            "mfu": statistics.median(metric_values(run, "train/mfu")[2:] or [float("nan")]),
            "failure": summary.get("failure"),
        }
        result["ok"] = result["ok"] and result[label]["ok"]
        if label == "eager":
            plain = statistics.median(plain_loop_tokens_per_s(job, shape.speed_steps))
            result.update(plain_tokens_per_s=plain, ratio=result[label]["tokens_per_s"] / plain)
            result["ok"] = result["ok"] and result["ratio"] >= SPEED_TARGET
    return result


def check_sync(shape: Shape, root: Path) -> dict[str, Any]:
    rows = {}
    ok = True
    for fmt in ("none", "fp4"):
        job = compose(
            shape,
            [
                f"model={shape.big_model}",
                "cluster.groups=2",
                f"trainer.batch_size={shape.batch}",
                f"trainer.seq_len={shape.seq}",
                f"trainer.max_steps={4 * shape.sync_every}",
                "trainer.eval_every=0",
                f"algo.sync_every={shape.sync_every}",
                f"algo.quantize={fmt}",
                "trainer.log_every=1",
            ],
        )
        run = root / f"sync_{fmt}"
        summary = run_job(job, run, keep_failure=True)
        syncs = metric_values(run, "outer/sync_ms")[1:]  # the first round also builds the lanes
        records = read_jsonl(RunPaths(run).metrics(0))
        steps = [r["train/step_ms"] for r in records if "train/step_ms" in r and "outer/sync_ms" not in r][5:]
        rows[fmt] = {
            "ok": bool(summary.get("ok")) and equal_digests(summary),
            "sync_ms": statistics.median(syncs or [float("nan")]),
            "inner_step_ms": statistics.median(steps or [float("nan")]),
            "bytes_sent": summary.get("bytes_sent"),
            "failure": summary.get("failure"),
        }
        ok = ok and rows[fmt]["ok"]
    return {"ok": ok, **rows}


def check_digest(shape: Shape, root: Path) -> dict[str, Any]:
    job = compose(shape, [f"model={shape.big_model}"])
    model = Transformer(job.model)
    theta_g = {name: p.detach().clone() for name, p in model.named_parameters()}
    momentum = {f"{name}.momentum": torch.zeros_like(p) for name, p in theta_g.items()}
    started = time.perf_counter()
    state_digest({**theta_g, **momentum})
    seconds = time.perf_counter() - started
    n_bytes = sum(t.numel() * t.element_size() for t in (*theta_g.values(), *momentum.values()))
    return {"ok": True, "parameters": count_parameters(model), "seconds": seconds, "gb_per_s": n_bytes / seconds / 1e9}


def check_faults(shape: Shape, root: Path, step_ms: float) -> dict[str, Any]:
    """A job long enough for several kills and hangs, from the smoke job's step time (NaN: 20 rounds)."""
    h = 50
    steps = 20 * h if step_ms != step_ms else max(4 * h, int(shape.fault_seconds * 1000 / step_ms) // h * h)
    job = compose(
        shape,
        [
            "model=tiny",
            "cluster.groups=3",
            f"algo.sync_every={h}",
            f"trainer.max_steps={steps}",
            "faults=kill_every",
            "faults.start_after=5",
            "faults.kill_every=8",
            "faults.hang_every=13",
            "faults.hang_seconds=4",
        ],
    )
    summary = run_job(job, root / "faults", keep_failure=True)
    kills = summary.get("faults", {}).get("kill", 0)
    recoveries = summary.get("recoveries", 0)
    return {
        "ok": bool(summary.get("ok")) and equal_digests(summary) and kills > 0,
        "steps": steps,
        "faults": summary.get("faults"),
        "recoveries": recoveries,
        "syncs": f"{summary.get('syncs_committed')}/{summary.get('syncs_attempted')}",
        "survivor_stall_s": summary.get("survivor_stall_s"),
        "wall_seconds": summary.get("wall_seconds"),
        "failure": summary.get("failure"),
    }


def check_hf(shape: Shape, root: Path) -> dict[str, Any]:
    """Import a Llama 3.2 1B-shaped transformers checkpoint, train 2 groups from it, export, compare logits."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from diloco.launch.export import export_checkpoint
    from diloco.train.hf_weights import load_pretrained

    device = torch.device(shape.device)
    source = root / "hf_source"
    started = time.perf_counter()
    with torch.device(device):
        hf_model = LlamaForCausalLM(LlamaConfig(**shape.hf_config)).to(torch.bfloat16)
    hf_model.save_pretrained(source)
    tokens = torch.randint(0, shape.hf_config["vocab_size"], (2, 256), device=device)
    made_s = time.perf_counter() - started

    overrides = [f"model.init_from={source}", "cluster.groups=2", f"algo.sync_every={shape.sync_every}"]
    overrides += [f"trainer.max_steps={2 * shape.sync_every}", "trainer.batch_size=4", "trainer.seq_len=512"]
    job = compose(shape, overrides)
    started = time.perf_counter()
    ours = Transformer(job.model).to(device)
    load_pretrained(ours, job.model)
    load_s = time.perf_counter() - started
    del hf_model  # its bf16 rotary buffer is not transformers' fp32 one: load the checkpoint as a user would
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(device)
    with torch.no_grad():
        import_diff = (ours(tokens) - reference(tokens).logits).abs().max().item()
    del ours, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the two groups' processes need the GPU next

    run = root / "hf_job"
    summary = run_job(job, run, keep_failure=True)
    started = time.perf_counter()
    exported = export_checkpoint(run / "model.pt", job, root / "hf_export")
    export_s = time.perf_counter() - started
    trained = Transformer(job.model).to(device)
    trained.load_state_dict(torch.load(run / "model.pt", map_location=device, weights_only=True))
    reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).to(device)
    with torch.no_grad():
        export_diff = (trained(tokens) - reloaded(tokens).logits).abs().max().item()
    ok = bool(summary.get("ok")) and equal_digests(summary) and max(import_diff, export_diff) < HF_LOGITS_TOLERANCE
    return {
        "ok": ok,
        "parameters": count_parameters(trained),
        "import_logits_max_diff": import_diff,
        "export_logits_max_diff": export_diff,
        "make_and_save_s": round(made_s, 1),
        "import_s": round(load_s, 1),
        "job_wall_s": summary.get("wall_seconds"),
        "eval_loss": summary.get("final_eval_loss"),
        "export_s": round(export_s, 1),
        "failure": summary.get("failure"),
    }


def report(results: dict[str, Any], machine: str) -> str:
    rows = []
    for name, result in results.items():
        detail = {k: v for k, v in result.items() if k not in ("ok", "logs") and v is not None}
        rows.append([name, verdict(result["ok"]), json.dumps(detail, default=str)[:400]])
    return f"{machine}\n\n" + markdown_table(["check", "result", "measured"], rows)


def machine_line(device: str) -> str:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "no GPU"
    return f"{gpu}; torch {torch.__version__}; python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same checks on the CPU at toy sizes")
    parser.add_argument("--out", help="also write the table and the raw results (JSON) to this folder")
    parser.add_argument("--keep-runs", metavar="DIR", help="keep the run directories under DIR")
    parser.add_argument("--model", help="the model of speed, sync and digest (default llama3_150m)")
    parser.add_argument("--steps", type=int, help="inner steps of the speed check (default 200)")
    parser.add_argument("--speed-rows", nargs="+", choices=SPEED_VARIANTS, help="the speed check's rows (default all)")
    args = parser.parse_args()
    stop_on_sigterm()
    shape = CPU_DRY if args.cpu_dry_run else GPU
    shape = dataclasses.replace(
        shape, big_model=args.model or shape.big_model, speed_steps=args.steps or shape.speed_steps
    )
    rows = args.speed_rows or list(SPEED_VARIANTS)
    if shape.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device; run with --cpu-dry-run to check the script on the CPU")
    machine = machine_line(shape.device)
    results: dict[str, Any] = {}
    with runs_root(args.keep_runs, "gpu_check") as root:
        step_ms = float("nan")
        for name in args.only:
            started = time.perf_counter()
            try:
                if name == "faults":
                    result = check_faults(shape, root, step_ms)
                elif name == "speed":
                    result = check_speed(shape, root, rows)
                else:
                    result = globals()[f"check_{name}"](shape, root)
            except Exception as error:  # one check's crash is its row, the others still run
                result = {"ok": False, "failure": f"{type(error).__name__}: {error}"}
            result["check_seconds"] = round(time.perf_counter() - started, 1)
            if name == "smoke":
                step_ms = result.get("step_ms", step_ms)
            results[name] = result
            print(f"{name}: {verdict(result['ok'])} {json.dumps(result, default=str)[:2000]}", flush=True)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    table = report(results, machine)
    print(table)
    path = write_result("gpu_check.md", table)
    if args.out:
        write_result("gpu_check.md", table, args.out)
    print(f"\nwritten to {path}")
    if not all(r["ok"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
