"""Activation checkpointing and torch.compile for each transformer block (``trainer.activation_checkpoint``,
``trainer.compile``).

Both wrap the block's body function (``TransformerBlock.wrap_body``), never the module: parameter
names, which the outer sync, the digests and checkpoints match by, stay those of the plain model,
and FSDP2's hooks on the block (its all-gathers) stay outside the wrapped computation. The
order is torchtitan's: checkpointing first, then compile around it, so compile traces the
checkpoint as one region. Nothing is traced until the first forward, which runs after the
tensor-parallel plan and FSDP2 are applied to the modules the body calls.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Iterable

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from diloco.config.base import check
from diloco.config.trainer import TrainerConfig
from diloco.train.model import BlockBody, TransformerBlock

_aten = torch.ops.aten
# Selective checkpointing keeps what is expensive to recompute, the matmuls and attention
# (torchtitan's op-level policy, without its trick of recomputing every second matmul), and
# recomputes in the backward pass what is cheap and memory-hungry: RMSNorm's and RoPE's fp32
# intermediates, SiLU and the SwiGLU product, the residual adds.
_SAVED_BY_SELECTIVE = [
    _aten.mm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
]


def apply_block_wrappers(blocks: Iterable[TransformerBlock], cfg: TrainerConfig, device: torch.device) -> None:
    """Checkpoint, then compile, every block as ``cfg`` asks (before FSDP2 shards them)."""
    check_compile(cfg, on_cpu=device.type == "cpu")
    for block in blocks:
        if cfg.activation_checkpoint != "none":
            block.wrap_body(functools.partial(checkpointed, selective=cfg.activation_checkpoint == "selective"))
        if cfg.compile:
            block.wrap_body(functools.partial(torch.compile, fullgraph=True))


def checkpointed(body: BlockBody, *, selective: bool) -> BlockBody:
    """``body`` keeping only its inputs for the backward pass (full) or also its matmul and
    attention outputs (selective); the rest is recomputed in the backward pass."""

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if selective:
            return checkpoint(body, x, cos, sin, use_reentrant=False, context_fn=_keep_matmuls_and_attention)
        return checkpoint(body, x, cos, sin, use_reentrant=False)

    return run


def _keep_matmuls_and_attention():
    return create_selective_checkpoint_contexts(_SAVED_BY_SELECTIVE)


def cpp_compiler_names() -> list[str]:
    """The C++ compilers inductor looks for on CPU (its ``cpp.cxx``; None there is a conda
    install it attempts only when asked). Importing inductor takes seconds: only when compiling."""
    from torch._inductor import config as inductor_config

    return [name for name in inductor_config.cpp.cxx if name]


def find_cpp_compiler() -> str | None:
    """The path of the first compiler inductor would use, or None."""
    return next((path for path in map(shutil.which, cpp_compiler_names()) if path), None)


def check_compile(cfg: TrainerConfig, *, on_cpu: bool) -> None:
    """Refuse ``trainer.compile=true`` on a CPU without a C++ compiler: inductor writes C++ for
    CPU kernels and would otherwise fail at the first forward, inside every worker."""
    if not cfg.compile or not on_cpu:
        return
    check(
        find_cpp_compiler() is not None,
        "trainer.compile",
        cfg.compile,
        f"torch.compile on CPU needs a C++ compiler and none of {', '.join(cpp_compiler_names())} is on PATH; "
        "install one (e.g. apt-get install g++) or set trainer.compile=false",
    )


def will_run_on_cpu(device_preference: str) -> bool:
    """Whether ``cluster.device`` resolves to the CPU on this machine (as ``select_device`` resolves it)."""
    return device_preference == "cpu" or (device_preference == "auto" and not torch.cuda.is_available())
