"""Activation checkpointing and torch.compile per block change no number and no name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from diloco.config.base import ConfigError
from diloco.config.model import ModelConfig
from diloco.config.trainer import TrainerConfig
from diloco.launch.launcher import launch
from diloco.run_paths import RunPaths
from diloco.train import block_wrappers
from diloco.train.block_wrappers import apply_block_wrappers, check_compile, find_cpp_compiler
from diloco.train.model import Transformer, param_signature
from diloco.worker.builders import preflight

CPU = torch.device("cpu")
TINY = ModelConfig()


def _model(activation_checkpoint: str = "none", compile: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(TINY)
    apply_block_wrappers(
        model.layers.values(), TrainerConfig(activation_checkpoint=activation_checkpoint, compile=compile), CPU
    )
    return model


def _loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=generator)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_gives_the_plain_loss_and_gradients(mode):
    """The recomputed forward is the same computation: equal within fp32 rounding (atol 1e-6)."""
    loss, grads = _loss_and_grads(_model())
    checkpointed_loss, checkpointed_grads = _loss_and_grads(_model(mode))
    torch.testing.assert_close(checkpointed_loss, loss, rtol=0, atol=1e-6)
    assert checkpointed_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_wrapped_blocks_keep_the_parameter_names_state_dict_keys_and_signature(monkeypatch):
    """The outer sync, the digests and checkpoints match parameters by name: no wrapper prefix."""
    monkeypatch.setattr(block_wrappers, "find_cpp_compiler", lambda: "/usr/bin/g++")  # compile traces lazily
    plain = _model()
    for mode in ("full", "selective"):
        for compile in (False, True):
            wrapped = _model(mode, compile)
            assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
            assert list(wrapped.state_dict()) == list(plain.state_dict())
            assert param_signature(TINY, wrapped) == param_signature(TINY, plain)


class _BackwardOps(TorchDispatchMode):
    """Counts the aten ops run while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _ops_in_backward(mode: str) -> dict[str, int]:
    model = _model(mode)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    loss = model(tokens).float().square().mean()
    with _BackwardOps() as ops:
        loss.backward()
    return ops.counts


def test_full_recomputes_each_block_and_selective_only_its_cheap_ops():
    """RMSNorm's rsqrt runs in the backward pass only when recomputed; a block's matmuls are
    recomputed by full checkpointing (q, k, v, o, w1, w3: the recomputation stops before w2, whose
    output no gradient needs), kept by selective."""
    plain, full, selective = (_ops_in_backward(mode) for mode in ("none", "full", "selective"))
    per_block = 6
    assert plain.get("rsqrt", 0) == 0
    assert full["rsqrt"] == selective["rsqrt"] == 2 * TINY.n_layers
    assert full["mm"] == plain["mm"] + per_block * TINY.n_layers
    assert selective["mm"] == plain["mm"]


def test_compile_without_a_cpp_compiler_is_refused_in_one_line_before_any_process_starts(
    monkeypatch, fast_job, tmp_path
):
    monkeypatch.setattr(block_wrappers, "find_cpp_compiler", lambda: None)
    monkeypatch.setattr(block_wrappers, "cpp_compiler_names", lambda: ["g++"])
    job = fast_job("trainer.compile=true", "cluster.device=cpu")
    with pytest.raises(ConfigError) as refused:
        preflight(job, RunPaths(tmp_path))
    assert str(refused.value) == (
        "trainer.compile=True: torch.compile on CPU needs a C++ compiler and none of g++ is on PATH; "
        "install one (e.g. apt-get install g++) or set trainer.compile=false"
    )
    check_compile(job.trainer, on_cpu=False)  # on GPUs inductor writes Triton kernels


@pytest.mark.slow
def test_compiled_checkpointed_blocks_give_the_eager_loss_and_gradients():
    """Inductor fuses and reorders fp32 arithmetic: equal within 1e-5 (compiling takes tens of seconds on CPU)."""
    if find_cpp_compiler() is None:
        pytest.skip("no C++ compiler for inductor on this machine")
    loss, grads = _loss_and_grads(_model())
    compiled_loss, compiled_grads = _loss_and_grads(_model("selective", compile=True))
    torch.testing.assert_close(compiled_loss, loss, rtol=0, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_selective_checkpointing_ends_two_groups_of_fsdp_workers_on_the_plain_runs_digests(fast_job, tmp_path):
    """2 groups x 2 FSDP2 workers, two outer rounds: checkpointing changes no bit of the global model.
    ``min_groups=2``: every round averages both groups, however the busy machine paces them."""
    shape = [
        "cluster.groups=2",
        "cluster.min_groups=2",
        "cluster.workers_per_group=2",
        "cluster.device=cpu",
        "trainer.max_steps=10",
        "algo.sync_every=5",
    ]
    plain = launch(fast_job(*shape), tmp_path / "plain")
    selective = launch(fast_job(*shape, "trainer.activation_checkpoint=selective"), tmp_path / "selective")
    assert plain["ok"] and selective["ok"], (plain["failure"], selective["failure"])
    digests = {g["digest"] for g in plain["per_group"] + selective["per_group"]}
    assert len(digests) == 1, (plain["per_group"], selective["per_group"])
