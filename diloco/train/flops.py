"""How well a group uses its hardware: model FLOPs per token, the devices' peak, and MFU."""

from __future__ import annotations

import functools
import itertools
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from diloco.config.model import ModelConfig


def non_embedding_parameters(cfg: ModelConfig) -> int:
    """N of the FLOPs count: every parameter but the token embedding table.

    An embedding lookup is a gather, no multiply-adds; the output head is a matmul and counts
    (tied, the shared matrix counts once, as the head).
    """
    q, dim = cfg.head_dim, cfg.dim
    attention = dim * cfg.n_heads * q + 2 * dim * cfg.n_kv_heads * q + cfg.n_heads * q * dim
    block = attention + 3 * dim * cfg.ffn_dim + 2 * dim  # SwiGLU's w1, w3, w2 and the two RMSNorms
    return cfg.n_layers * block + dim + cfg.vocab_size * dim  # final norm, output head


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward and backward) as PaLM counts them (Chowdhery et al.
    2022, appendix B): 6N + 12·L·H·Q·T.

    6N: each weight does one multiply-add (2 FLOPs) per token in the forward pass and two in the
    backward pass; N is ``non_embedding_parameters`` (PaLM's N; torchtitan and nanoGPT leave the
    lookup table out too). 12·L·H·Q·T: in each of L layers, QKᵀ and the weighted sum of V cost
    2·H·Q·T FLOPs each per token forward (H query heads of width Q over T = ``seq_len``
    positions), three times that with the backward pass. As in PaLM the whole T×T score matrix
    counts although the causal mask leaves half of it unused, and activation checkpointing's
    recomputation does not count: these are model FLOPs (MFU), not hardware FLOPs.
    """
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return 6 * non_embedding_parameters(cfg) + attention


# bf16 dense (no sparsity) tensor-core TFLOP/s from NVIDIA's data sheets, by the words of
# torch.cuda.get_device_name; a qualified name comes before its family's.
KNOWN_PEAK_TFLOPS: tuple[tuple[frozenset[str], float], ...] = (
    (frozenset({"H100", "PCIe"}), 756.0),
    (frozenset({"H100", "NVL"}), 835.0),
    (frozenset({"H100"}), 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    (frozenset({"GH200"}), 989.0),
    (frozenset({"H200"}), 989.0),
    (frozenset({"B200"}), 2250.0),
    (frozenset({"A100"}), 312.0),
    (frozenset({"L40S"}), 362.0),
    (frozenset({"L4"}), 121.0),
    (frozenset({"A10"}), 125.0),
)


def known_peak_tflops(device_name: str) -> float | None:
    """The data-sheet peak of a GPU named ``device_name`` (e.g. ``NVIDIA H100 80GB HBM3``), or None."""
    words = set(re.split(r"[^A-Za-z0-9]+", device_name))
    return next((tflops for needed, tflops in KNOWN_PEAK_TFLOPS if needed <= words), None)


# How the local launcher hands its measured peak to a worker (``WorkerEnv`` carries it).
PEAK_ENV = "DILOCO_PEAK_TFLOPS"
PEAK_SOURCE_ENV = "DILOCO_PEAK_SOURCE"
LAUNCHER_BUDGET_S = 0.5  # once per launcher, so it can afford to outwait a busy moment


@dataclass(frozen=True)
class Peak:
    """One device's peak TFLOP/s and where the figure comes from (said in the worker's log)."""

    tflops: float
    source: str

    def to_environ(self) -> dict[str, str]:
        """The variables that hand this figure to a worker (``handed_peak`` reads them)."""
        return {PEAK_ENV: repr(self.tflops), PEAK_SOURCE_ENV: self.source}


def handed_peak(environ: Mapping[str, str]) -> Peak | None:
    """The peak the local launcher measured for this worker, if it handed one over."""
    if PEAK_ENV not in environ:
        return None
    return Peak(float(environ[PEAK_ENV]), environ[PEAK_SOURCE_ENV])


def device_peak(setting: float, device: torch.device, handed: Peak | None = None) -> Peak:
    """``cluster.peak_tflops`` when set; else a known GPU's data-sheet figure; else the CPU figure
    the local launcher ``handed`` over; else measured here (under torchrun nobody hands one over)."""
    if setting > 0:
        return Peak(setting, "cluster.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = known_peak_tflops(name)
        if known is not None:
            return Peak(known, f"{name}, bf16 dense, from its data sheet")
    return handed or measured_peak(device)


@functools.cache  # once per worker process: the figure does not change while it trains
def measured_peak(device: torch.device) -> Peak:
    """This worker's own measurement (``best_matmul_tflops``); the other processes on the same
    cores at that moment lower it, which is why a local launcher measures for its workers."""
    dtype, n = matmul_shape(device)
    return Peak(best_matmul_tflops(device), f"measured: best {dtype} {n}x{n} matmul on {device.type}")


def matmul_shape(device: torch.device) -> tuple[torch.dtype, int]:
    """The dtype the trainer computes in (fp32 on CPU, bf16 under autocast on CUDA) and a size that keeps the device busy."""
    return (torch.bfloat16, 8192) if device.type == "cuda" else (torch.float32, 512)


def best_matmul_tflops(
    device: torch.device, budget_s: float = 0.2, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The best rate of square matmuls over about ``budget_s`` of wall time: the best attempt is
    the one least disturbed by whatever else runs on the device. ``clock`` times each attempt."""
    dtype, n = matmul_shape(device)
    generator = torch.Generator(device).manual_seed(0)  # the global one seeds the model and data
    a, b = (torch.rand(n, n, device=device, dtype=dtype, generator=generator) for _ in range(2))
    best = 0.0
    deadline = time.perf_counter() + budget_s
    for attempt in itertools.count():
        started = clock()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        finished = clock()
        if attempt > 0:  # the first call pays for allocation and kernel selection
            best = max(best, 2 * n**3 / (finished - started) / 1e12)
        if attempt >= 3 and time.perf_counter() > deadline:
            return best


def one_core_tflops() -> float:
    """``best_matmul_tflops`` on one CPU core: one intra-op thread (this process's own thread
    count is restored after), timed by its own CPU time, which other processes taking turns on
    the core do not stretch. Under a load of 7 on 2 cores the wall clock's median attempt read
    0.02 TFLOP/s and its best 0.09, the CPU time's 0.08 and 0.09; all cores at once read as
    little as a tenth of their idle rate, as one thread's wait holds up the others."""
    own = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best_matmul_tflops(torch.device("cpu"), LAUNCHER_BUDGET_S, clock=time.thread_time)
    finally:
        torch.set_num_threads(own)


def cores_per_worker(threads: int, workers: int, cores: int) -> float:
    """The cores a worker's peak counts: its threads, but never more than its share of the
    machine, so ``workers`` of them together never claim more than ``cores`` (4 one-thread
    workers on 2 cores count half a core each, not a whole one)."""
    return min(threads, cores / workers)


@functools.cache  # a process that launches several jobs of one shape measures once
def launcher_cpu_peak(threads: int, workers: int, cores: int) -> Peak:
    """The peak of each of ``workers`` CPU workers running ``threads`` threads on ``cores`` cores:
    one core's, measured by the launcher before any worker starts, times ``cores_per_worker``.
    The machine is idle then, so every worker gets one figure, alike from run to run (each
    measuring its own while the others imported and built swung MFU several-fold); and a
    core's rate times the cores is the machine's peak however many threads a worker runs."""
    one_core = one_core_tflops()
    share = cores_per_worker(threads, workers, cores)
    dtype, n = matmul_shape(torch.device("cpu"))
    plural = "s" if threads > 1 else ""
    return Peak(
        one_core * share,
        f"measured once by the launcher on the idle machine: best {dtype} {n}x{n} matmul on one core "
        f"({one_core:.4g}) x {share:.3g} cores per worker ({workers} x {threads} thread{plural} on {cores} cores)",
    )


@dataclass(frozen=True)
class Utilization:
    """Turns a group's tokens/s into its achieved TFLOP/s and MFU (the fraction of its devices' peak)."""

    flops_per_token: int
    peak_tflops: float  # the whole group's: every device's peak

    def metrics(self, tokens_per_s: float) -> dict[str, float]:
        tflops = self.flops_per_token * tokens_per_s / 1e12
        return {"train/tflops": tflops, "train/mfu": tflops / self.peak_tflops}
