"""What grows with the model, against what the machine can do: an outer round's phases and a heal, per size.

For each Llama preset of the ladder (``--sizes``: tiny, mini, midi, llama3_150m by default;
``llama3_300m`` is the largest whose two groups fit 24 GiB) and one run each:

1. the bare figures, between two processes of one thread each on loopback Gloo, as the job's
   groups are: the all-reduce of the model's fp32 values (median of ``--reps``), a send of a
   heal's bytes (θ_g, outer momentum, AdamW's two moments: 16 bytes a parameter), and a heal's
   transfer of a state of the model's shapes through ``HealState``, timed to its arrival and apply,
   then again into the pages the first one's staging freed (a restarted process's staging is
   pages it never touched: on a virtual machine that hands freed pages back to its host, a first
   touch costs several times a page fault);
   and the outer step alone on the model's shapes, with torch.optim.SGD and with the project's SGD
   that steps in Δ̄ itself (``outer_opt.optimizers.InPlaceSGD``), both processes stepping at once;
2. the job: 2 groups x 1 worker, DiLoCo fp32, H = 5, batch 1 x 32 tokens, group 1 SIGKILLed
   once after its second commit and restarted, so it heals from group 0. From the commit
   records: a committed round's ``sync_ms`` (the training thread's whole wait, digest included
   unless hashed beside the inner steps) and the median of each phase (docs/algorithm.md, "An
   outer round's phases"), the healing round's ``heal`` phase (waiting for the peer's round
   included), death to the restarted group's first commit, and the peak resident memory of the
   worker that trained throughout (group 0, which served the heal) and of the one that healed;
   beside them the peak of a plain loop (``algo=local``: the same worker, model, batch and AdamW,
   with no outer sync), so what DiLoCo adds is read in bytes a parameter, measured;
3. a checkpoint of a worker's state of the model's shapes (θ_l, AdamW, θ_g, momentum: 20 bytes a
   parameter) saved and loaded beside a bare write and read of the same bytes (``checkpoint_io``);
4. with ``--variants``, the same job per payload and layout (``VARIANTS``: Streaming P=4 τ=1 fp4,
   the sparse recipe's 1% 2-bit top-k, fp32 on 2 x 2 FSDP2 workers), each beside the bare
   collective of what one lane carries in one (fragment) round: an all-reduce of a worker's fp32
   shard, or an all-gather of the packed payload's bytes (the fragment's share taken as numel / P:
   fragments are cut at blocks, so near it). A variant a size cannot run (P fragments need P
   blocks) is skipped, saying why.

Ratios are to the bare figure measured in the same run: round / all-reduce, a heal's transfer
(``HealState.send`` / ``receive`` between the same two processes) / the bare send of its bytes,
a checkpoint's save / the bare write synced, its load / the bare read.
The machine's free memory is touched once first (``warm_memory``).

    python -m experiments.scale.bench_model_size                  # the ladder to 150M: ~15 min on two idle cores
    python -m experiments.scale.bench_model_size --quick        # tiny only: a smoke test, ~30 s
    python -m experiments.scale.bench_model_size --sizes llama3_150m \
        --variants "streaming P=4 τ=1 fp4" "sparse 1% 2-bit" "fp32, 2 x 2 FSDP2"   # a job each beside fp32

    python -m experiments.scale.bench_model_size --from experiments/results/bench_model_size.json  # tables again

Prints a markdown table and each cost fitted as a fixed part plus a per-byte part beside its bare
figure's (``cost_lines``); writes them to experiments/results/bench_model_size.md, every figure
to bench_model_size.json and the costs against the parameters to bench_model_size.png. Timings
on a shared 2-core machine are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diloco.config.base import ConfigError
from diloco.ft.state import HealState, Position
from diloco.ft.transport import CHUNK_BYTES
from diloco.outer.codecs import Codec, Dense, codec_for
from diloco.outer.update import outer_update
from diloco.train.inner_opt import init_adamw_state
from diloco.train.model import count_parameters, meta_model
from experiments.common import ClusterRun, add_output_arguments, compose_job, markdown_table, runs_root, write_result
from experiments.scale.checkpoint_io import checkpoint_figures
from experiments.scale.cost_lines import fit_table, plot
from outer_opt import OuterOptConfig, build_outer_optimizer, initialize_state

H = 5
# Inner steps per size: enough that group 0 is still training when the killed group 1 is back (a
# restart takes 8-13 s on two cores), and at least 8 rounds.
STEPS = {"tiny": 2000, "mini": 2000, "midi": 500}
MIN_STEPS = 8 * H
HEAL_BYTES_PER_PARAM = 16  # θ_g, the outer momentum and AdamW's two moments, fp32 (``_bytes_by_kind``)
PLAIN_STEPS = 2 * H  # the plain loop's: its peak is reached at the first optimizer step
SHAPE = ["trainer.batch_size=1", "trainer.seq_len=32", "trainer.warmup_share=0", "algo.sync_warmup_steps=0"]
PHASES = ("delta", "quorum", "finite", "encode", "wire", "decode", "commit", "outer_step", "digest")
STREAMING_H = 8  # a multiple of its P = 4 fragments: a fragment round every 2 inner steps


@dataclass(frozen=True)
class Variant:
    """A payload and layout of the job beside plain DiLoCo fp32 on one worker a group."""

    overrides: tuple[str, ...]
    h: int = H
    workers: int = 1
    fragments: int = 1

    def codec(self, size: str) -> Codec:
        return codec_for(compose_job([f"model={size}", *self.overrides]).algo)

    def steps(self, size: str) -> int:
        """The job's inner steps at ``size``: ``STEPS`` rounded up to whole windows (the last round reaches θ_g)."""
        return -(-STEPS.get(size, MIN_STEPS) // self.h) * self.h

    def misfit(self, size: str) -> str | None:
        """Why the variant's job cannot run at ``size`` (P fragments need P blocks), or None."""
        try:
            compose_job([f"model={size}", *self.overrides, f"trainer.max_steps={self.steps(size)}"])
        except ConfigError as error:
            return str(error)
        return None

    def round_numel(self, numel: int) -> int:
        """Values one lane carries in one (fragment) round: a fragment's share, a worker's shard of it."""
        return numel // (self.fragments * self.workers)

    def collective(self, size: str, numel: int) -> tuple[str, int]:
        """The bare collective of one lane's round: ("allreduce", fp32 values) or ("allgather", bytes)."""
        codec, values = self.codec(size), self.round_numel(numel)
        return ("allreduce", values) if isinstance(codec, Dense) else ("allgather", codec.nbytes(values))


VARIANTS = {
    "fp32": Variant((f"algo.sync_every={H}",)),
    "streaming P=4 τ=1 fp4": Variant(
        ("algo=streaming", f"algo.sync_every={STREAMING_H}", "algo.fragments=4", "algo.delay=1", "algo.quantize=fp4"),
        h=STREAMING_H,
        fragments=4,
    ),
    "sparse 1% 2-bit": Variant(
        (f"algo.sync_every={H}", "algo.compress=topk", "algo.density=0.01", "algo.value_bits=2", "algo.alpha=0")
        + ("outer_opt=sgd", "outer_opt.lr=1", "outer_opt.momentum=0")
    ),
    "fp32, 2 x 2 FSDP2": Variant((f"algo.sync_every={H}", "cluster.workers_per_group=2"), workers=2),
}


def _heal_state(shapes: list[torch.Size]) -> HealState:
    """A worker's state of the model's shapes: θ_g with DiLoCo's outer Nesterov, AdamW's moments."""
    theta_g = [torch.nn.Parameter(torch.rand(shape)) for shape in shapes]
    outer = build_outer_optimizer(theta_g, OuterOptConfig())
    params = [torch.nn.Parameter(torch.rand(shape)) for shape in shapes]
    inner = torch.optim.AdamW(params)
    init_adamw_state(inner)
    return HealState(global_params=[theta_g], outer_optimizers=[outer], inner_optimizer=inner)


def _bare_peer(
    rank: int, port: int, shapes: list[torch.Size], reps: int, collectives: dict[str, tuple[str, int]], out: Any
) -> None:
    """Rank 1 of two: the bare all-reduce, each variant's collective (``Variant.collective``) and
    send, then a heal's transfer from rank 0, timed."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    numel = sum(shape.numel() for shape in shapes)
    values = torch.ones(numel)
    reduce_ms = []
    for _ in range(reps):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(values)
        reduce_ms.append(1000 * (time.perf_counter() - started))
    del values
    collective_ms = {name: _collective_ms(kind, count, reps) for name, (kind, count) in collectives.items()}
    outer_step_ms = {kind: _outer_step_ms(shapes, reps, kind) for kind in ("torch", "in place")}
    heal = torch.ones(numel * HEAL_BYTES_PER_PARAM // 4)  # touched on both sides: the wire alone
    chunk = CHUNK_BYTES // 4
    dist.barrier()
    started = time.perf_counter()
    op = dist.isend if rank == 0 else dist.irecv
    for work in [op(heal[i : i + chunk], 1 - rank) for i in range(0, heal.numel(), chunk)]:
        work.wait()
    send_ms = 1000 * (time.perf_counter() - started)
    del heal
    state = _heal_state(shapes)
    lane = dist.group.WORLD
    position = Position(committed=1, inner_step=5, round_step=5)
    transfer_ms, apply_ms = [], []
    for _ in range(2):  # the second into the pages the first's staging just freed
        dist.barrier()
        started = time.perf_counter()
        if rank == 0:
            state.send(lane, 1, position, timeout_s=600)
        else:
            staged = state.receive(lane, 0, timeout_s=600)
            received = time.perf_counter()
            state.apply(staged)
            del staged
            transfer_ms.append(1000 * (received - started))
            apply_ms.append(1000 * (time.perf_counter() - received))
    if rank == 1:
        out.put(
            {
                "allreduce_ms": statistics.median(reduce_ms),
                "collective_ms": collective_ms,
                "outer_step_alone_ms": outer_step_ms,
                "send_ms": send_ms,
                "heal_transfer_ms": transfer_ms[0],
                "heal_again_ms": transfer_ms[1],
                "heal_apply_ms": apply_ms[0],
                "heal_bytes": _bytes_by_kind(state),
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def _collective_ms(kind: str, count: int, reps: int) -> float:
    """The median of ``reps`` bare all-reduces of ``count`` fp32 values, or all-gathers of ``count`` bytes."""
    took = []
    if kind == "allreduce":
        values = torch.ones(count)
        run = lambda: dist.all_reduce(values)  # noqa: E731
    else:
        payload = torch.ones(count, dtype=torch.uint8)
        gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size())]
        run = lambda: dist.all_gather(gathered, payload)  # noqa: E731
    for _ in range(reps):
        dist.barrier()
        started = time.perf_counter()
        run()
        took.append(1000 * (time.perf_counter() - started))
    return statistics.median(took)


def _outer_step_ms(shapes: list[torch.Size], reps: int, kind: str) -> float:
    """DiLoCo's outer step alone (``outer_update``: Nesterov over θ_g of the model's shapes, then θ_l ←
    θ_g), the median of ``reps``: with torch.optim.SGD (``torch``), or the project's SGD that steps in
    Δ̄ itself (``in place``). Both processes step at once, as the job's two groups do."""
    theta_g = [torch.nn.Parameter(torch.rand(shape), requires_grad=False) for shape in shapes]
    theta_l = [p.detach().clone() for p in theta_g]
    if kind == "torch":
        outer = torch.optim.SGD(theta_g, lr=0.7, momentum=0.9, nesterov=True)
        initialize_state(outer, lambda p, group: {"momentum_buffer": torch.zeros_like(p)})
    else:
        outer = build_outer_optimizer(theta_g, OuterOptConfig())
    mean_delta = torch.full((sum(shape.numel() for shape in shapes),), 1e-3)
    for p in theta_g:  # a fresh zeros_like may leave its pages untouched: touch them before the clock starts
        outer.state[p]["momentum_buffer"].zero_()
    took = []
    for _ in range(reps):
        mean_delta.fill_(1e-3)
        dist.barrier()
        started = time.perf_counter()
        outer_update(theta_g, theta_l, mean_delta, outer, alpha=0.0)
        took.append(1000 * (time.perf_counter() - started))
    return statistics.median(took)


def _bytes_by_kind(state: HealState) -> dict[str, int]:
    """The heal's bytes by kind: θ_g, the outer optimizer's state, the inner optimizer's."""
    kinds: dict[str, int] = {}
    for name, tensor in state.tensors().items():
        kind = {"global": "theta_g", "outer": "outer state", "inner": "inner state"}[name.split(".")[0]]
        kinds[kind] = kinds.get(kind, 0) + tensor.numel() * tensor.element_size()
    return kinds


def bare(shapes: list[torch.Size], reps: int, collectives: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """The bare all-reduce of the model's fp32 values, each of ``collectives``, a send of a heal's
    bytes, and a heal's transfer (``HealState``), between two processes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as probe:  # a free port for the pair's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=_bare_peer, args=(r, port, shapes, reps, collectives, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    return result


def job_figures(size: str, run_dir: Path, variant: Variant = VARIANTS["fp32"]) -> dict[str, Any]:
    """Run the 2-group job at ``size`` with one kill of group 1, and read its round, heal and memory figures."""
    steps = f"trainer.max_steps={variant.steps(size)}"
    job = compose_job([f"model={size}", "cluster.groups=2", *variant.overrides, steps, *SHAPE])
    with ClusterRun(job, run_dir) as run:
        committed = lambda g: [r for r in run.commits(g) if r["committed"]]  # noqa: E731
        run.cluster.wait_for(lambda: len(committed(1)) >= 2, 1800, "group 1's second commit", poll_s=1.0)
        run.cluster.signal_group(1, signal.SIGKILL)
        killed_at = time.time()
        run.cluster.start_group(1)
        run.cluster.wait_for(run.cluster.finished, 3600, "the job's end", poll_s=1.0)
        records = [r for g in range(2) for r in run.commits(g)]
        restarted = [r for r in run.commits(1) if r["time"] > killed_at]
    rounds = [r for r in records if r["committed"] and not r.get("join")]
    heals = [r["phases_ms"]["heal"] for r in records if r.get("healed") and "heal" in r.get("phases_ms", {})]
    back = [r["time"] for r in rounds if r["time"] > killed_at and r in restarted]
    results = {g: json.loads(path.read_text()) for g in range(2) if (path := run.paths.result(g)).exists()}
    return {
        "ok": len(results) == 2,
        "sync_ms": statistics.median(r["sync_ms"] for r in rounds),
        "phases_ms": {p: statistics.median(r["phases_ms"].get(p, 0.0) for r in rounds) for p in PHASES},
        "heal_ms": max(heals) if heals else None,
        "death_to_commit_s": min(back) - killed_at if back else None,
        "peak_rss_mb": results[0]["peak_rss_mb"] if 0 in results else None,  # trained throughout, served the heal
        "healed_peak_rss_mb": results[1]["peak_rss_mb"] if 1 in results else None,
    }


def plain_peak_rss_mb(size: str, run_dir: Path, workers: int = 1) -> float | None:
    """A worker's peak resident memory in a plain loop: the job's worker with ``algo=local`` (no outer
    sync, nothing beside the model, its gradients and AdamW), one group, the same shape."""
    steps = f"trainer.max_steps={PLAIN_STEPS}"
    job = compose_job(
        [f"model={size}", "algo=local", "cluster.groups=1", f"cluster.workers_per_group={workers}", steps]
        + [o for o in SHAPE if not o.startswith("algo.")]
    )
    with ClusterRun(job, run_dir) as run:
        run.cluster.wait_for(run.cluster.finished, 1800, "the plain loop's end", poll_s=1.0)
        path = run.paths.result(0)
    return json.loads(path.read_text())["peak_rss_mb"] if path.exists() else None


def added_bytes_per_param(peak_mb: float | None, plain_mb: float | None, parameters: int) -> str:
    """What a worker holds beside the plain loop's, in bytes a parameter of its shard (``parameters``)."""
    return "n/a" if peak_mb is None or plain_mb is None else f"{(peak_mb - plain_mb) * 2**20 / parameters:.1f}"


def memory_cells(job: dict[str, Any], parameters: int) -> list[str]:
    """Peak RSS of the worker that trained throughout, of the one that healed, and of the plain loop, in MB;
    then what each of the first two holds beside the plain loop, in bytes a parameter of a worker's shard."""
    plain = job.get("plain_peak_rss_mb")
    peaks = (job["peak_rss_mb"], job.get("healed_peak_rss_mb"))
    return [
        " / ".join(_ms(mb) for mb in (*peaks, plain)),
        " / ".join(added_bytes_per_param(mb, plain, parameters) for mb in peaks),
    ]


def warm_memory(fraction: float = 0.8) -> None:
    """Touch most of the machine's free memory once and free it. A virtual machine may back a guest
    page only at its first touch, ten times slower than a page fault (here: a 2.4 GB buffer took 6 s
    to fill the first time, 0.9 s after), which would otherwise land on whichever run first needs
    that much memory."""
    available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))
    block = torch.empty(int(available * fraction), dtype=torch.uint8)
    for start in range(0, block.numel(), 1 << 28):
        block[start : start + (1 << 28)].zero_()
    del block


def measure(size: str, reps: int, root: Path, variants: tuple[str, ...] = ()) -> dict[str, Any]:
    """One size's row: the bare figures, a checkpoint, the fp32 job, and each of ``variants``'s job
    beside the bare collective of one lane's round of it (``variants``: names of ``VARIANTS``)."""
    model = meta_model(compose_job([f"model={size}"]).model)
    numel = count_parameters(model)
    print(f"{size}: {numel / 1e6:.1f}M parameters", file=sys.stderr, flush=True)
    shapes = [p.shape for p in model.parameters()]
    misfits = {name: VARIANTS[name].misfit(size) for name in variants}
    for name, why in misfits.items():
        if why is not None:
            print(f"{size}: {name} skipped: {why}", file=sys.stderr, flush=True)
    fitting = [name for name, why in misfits.items() if why is None]
    collectives = {name: VARIANTS[name].collective(size, numel) for name in fitting}
    row = {"size": size, "parameters": numel} | bare(shapes, reps, collectives)
    row |= checkpoint_figures(shapes, root / size / "checkpoint")
    plain = {
        w: plain_peak_rss_mb(size, root / size / f"plain_{w}", w) for w in {1} | {VARIANTS[n].workers for n in fitting}
    }
    row |= job_figures(size, root / size) | {"plain_peak_rss_mb": plain[1]}
    row["variants"] = {}
    for name in fitting:
        kind, count = collectives[name]
        figures = job_figures(size, root / size / re.sub(r"[^A-Za-z0-9]+", "_", name), VARIANTS[name])
        figures["plain_peak_rss_mb"] = plain[VARIANTS[name].workers]
        round_bytes = 4 * count if kind == "allreduce" else count
        row["variants"][name] = figures | {
            "collective": kind,
            "round_bytes": round_bytes,
            "bare_ms": row["collective_ms"][name],
        }
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}x" if a is not None and b else "n/a"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "model",
        "parameters",
        "bare all-reduce ms",
        "round ms (sync_ms)",
        "round / all-reduce",
        "wire ms",
        "round's other phases ms",
        "outer step alone ms: torch's SGD / in place",
        "bare send of a heal's bytes ms",
        "heal transfer ms: first / again",
        "transfer / send: first / again",
        "heal apply ms",
        "heal in the job ms",
        "death to commit s",
        "peak RSS per worker MB: trained / healed / plain loop",
        "DiLoCo adds B/param: trained / healed",
        "checkpoint MB",
        "bare write ms: alone / synced",
        "checkpoint save ms",
        "save / synced write",
        "bare read ms",
        "checkpoint load ms",
        "load / read",
    ]
    body = []
    for r in rows:
        others = ", ".join(f"{p} {ms:,.0f}" for p, ms in r["phases_ms"].items() if p != "wire" and ms >= 1)
        body.append(
            [
                r["size"],
                f"{r['parameters'] / 1e6:.1f}M",
                _ms(r["allreduce_ms"]),
                _ms(r["sync_ms"]),
                _ratio(r["sync_ms"], r["allreduce_ms"]),
                _ms(r["phases_ms"].get("wire")),
                others or "-",
                " / ".join(_ms(r["outer_step_alone_ms"][kind]) for kind in ("torch", "in place")),
                _ms(r["send_ms"]),
                f"{_ms(r['heal_transfer_ms'])} / {_ms(r.get('heal_again_ms'))}",
                f"{_ratio(r['heal_transfer_ms'], r['send_ms'])} / {_ratio(r.get('heal_again_ms'), r['send_ms'])}",
                _ms(r["heal_apply_ms"]),
                _ms(r["heal_ms"]),
                "n/a" if r["death_to_commit_s"] is None else f"{r['death_to_commit_s']:.1f}",
                *memory_cells(r, r["parameters"]),
                f"{r['checkpoint_bytes'] / 2**20:,.0f}",
                f"{_ms(r['raw_write_ms'])} / {_ms(r['raw_write_synced_ms'])}",
                _ms(r["save_ms"]),
                _ratio(r["save_ms"], r["raw_write_synced_ms"]),
                _ms(r["raw_read_ms"]),
                _ms(r["load_ms"]),
                _ratio(r["load_ms"], r["raw_read_ms"]),
            ]
        )
    return markdown_table(headers, body)


def variants_table(rows: list[dict[str, Any]]) -> str:
    """Each size's job per payload and layout, fp32 on one worker a group first, beside the bare
    collective (all-reduce or all-gather) of what one lane carries in one (fragment) round."""
    headers = [
        "model",
        "payload, layout",
        "a lane's round MB",
        "bare collective ms",
        "round ms (sync_ms)",
        "round / bare",
        "wire ms",
        "round's other phases ms",
        "heal in the job ms",
        "death to commit s",
        "peak RSS per worker MB: trained / healed / plain loop",
        "DiLoCo adds B/param of a shard: trained / healed",
    ]
    body = []
    for r in rows:
        fp32 = r | {"collective": "allreduce", "round_bytes": 4 * r["parameters"], "bare_ms": r["allreduce_ms"]}
        for name, job in ({"fp32": fp32} | r.get("variants", {})).items():
            bare_ms = job["bare_ms"]
            others = ", ".join(f"{p} {ms:,.0f}" for p, ms in job["phases_ms"].items() if p != "wire" and ms >= 1)
            body.append(
                [
                    r["size"],
                    name,
                    f"{job['round_bytes'] / 2**20:.3g}",
                    f"{_ms(bare_ms)} ({job['collective'].replace('all', 'all-')})",
                    _ms(job["sync_ms"]),
                    _ratio(job["sync_ms"], bare_ms),
                    _ms(job["phases_ms"].get("wire")),
                    others or "-",
                    _ms(job["heal_ms"]),
                    "n/a" if job["death_to_commit_s"] is None else f"{job['death_to_commit_s']:.1f}",
                    *memory_cells(job, r["parameters"] // VARIANTS[name].workers),
                ]
            )
    return markdown_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "mini", "midi", "llama3_150m"], help="model presets")
    parser.add_argument("--reps", type=int, default=5, help="bare all-reduces per size (their median)")
    parser.add_argument(
        "--variants",
        nargs="*",
        choices=[name for name in VARIANTS if name != "fp32"],
        default=[],
        help="payloads and layouts to run beside fp32 on one worker a group, each a job per size",
    )
    parser.add_argument("--quick", action="store_true", help="tiny only, one all-reduce, memory left as it is")
    parser.add_argument("--from", dest="source", metavar="JSON", help="tables and plot of an earlier run's figures")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.source:
        rows = json.loads(Path(args.source).read_text())
    else:
        if args.quick:
            args.sizes, args.reps = ["tiny"], 1
        else:
            warm_memory()
        with runs_root(args.keep_runs, "bench_model_size") as root:
            rows = [measure(size, args.reps, root, tuple(args.variants)) for size in args.sizes]
        path = write_result("bench_model_size.json", json.dumps(rows, indent=2), args.results)
        print(f"figures written to {path}", file=sys.stderr)
    text = f"{table(rows)}\n\nEach cost as fixed + per byte (experiments/scale/cost_lines.py):\n\n{fit_table(rows)}"
    if any(r.get("variants") for r in rows):
        text += f"\n\nPayloads and layouts, a job each:\n\n{variants_table(rows)}"
    print(text)
    path = write_result("bench_model_size.md", text, args.results)
    print(plot(rows, path.with_suffix(".png")), file=sys.stderr)
    sys.exit(0 if all(r["ok"] and all(v["ok"] for v in r.get("variants", {}).values()) for r in rows) else 1)


if __name__ == "__main__":
    main()
