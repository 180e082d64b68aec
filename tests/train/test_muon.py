"""inner_opt=muon (diloco/train/muon.py): the Newton–Schulz iteration, which parameters take Muon, a
step, its state (created at construction, carried by a heal and by state_dict) and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from diloco.config.base import ConfigError
from diloco.config.inner_opt import KEYS_READ, InnerOptConfig
from diloco.config.model import ModelConfig
from diloco.ft.state import HealState, create_state_to_fill, inner_optimizer_tensors
from diloco.launch.compose import compose_raw
from diloco.train.inner_opt import build_inner_optimizer
from diloco.train.model import Transformer
from diloco.train.muon import Muon, hidden_matrices, newton_schulz, rms_scale
from tests.conftest import compose_job

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
MUON = InnerOptConfig(name="muon", warmup_steps=0)
HIDDEN = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2")
HIDDEN += ("feed_forward.w3",)


def muon_for(model: torch.nn.Module, cfg: InnerOptConfig = MUON) -> Muon:
    optimizer, _ = build_inner_optimizer(list(model.parameters()), cfg, 10, hidden_matrices(model))
    assert isinstance(optimizer, Muon)
    return optimizer


def model(tied: bool = False, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = TINY if not tied else ModelConfig(**{**TINY.__dict__, "tie_embeddings": True})
    return Transformer(cfg)


def train_step(m: Transformer, optimizer: torch.optim.Optimizer, seed: int = 1) -> None:
    tokens = torch.randint(0, TINY.vocab_size, (4, 16), generator=torch.Generator().manual_seed(seed))
    loss = F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (96, 64), (8, 256), (64, 64)])
def test_newton_schulz_gives_singular_values_near_one(shape):
    """The quintic's coefficients trade exactness for speed: 5 steps leave every singular value of a
    rectangular matrix in about [0.7, 1.2]. A square Gaussian's smallest ones start near 0 and are still
    on their way up after 5 steps (the iteration multiplies them by ~3.4 each), so there the bulk is checked."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g, 5))
    inside = ((s > 0.65) & (s < 1.25)).float().mean().item()
    assert s.max() < 1.25
    if shape[0] == shape[1]:
        assert inside > 0.9, s
    else:
        assert inside == 1.0, s
    assert newton_schulz(g, 5).shape == g.shape


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_muon_takes_the_blocks_matrices_and_adamw_the_embeddings_head_and_norms(tied):
    m = model(tied)
    optimizer = muon_for(m)
    names = {id(p): name for name, p in m.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    assert muon == {f"layers.{i}.{h}.weight" for i in range(TINY.n_layers) for h in HIDDEN}
    head = set() if tied else {"output.weight"}  # tied: the one table is tok_embeddings.weight
    assert adamw == {"tok_embeddings.weight", "norm.weight", *head} | {
        f"layers.{i}.{n}.weight" for i in range(TINY.n_layers) for n in ("attention_norm", "ffn_norm")
    }
    decay = {names[id(p)]: g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decay["tok_embeddings.weight"] == decay["layers.0.attention.wq.weight"] == MUON.weight_decay
    assert decay["norm.weight"] == 0.0


def test_a_step_moves_every_weight_and_the_state_holds_momentum_and_adam_moments():
    m = model()
    optimizer = muon_for(m)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for p in m.parameters():  # all there before any step, at zero (a heal receives into them)
        state = optimizer.state[p]
        assert state["step"].item() == 0 and all(not v.any() for k, v in state.items() if k != "step")
    train_step(m, optimizer)
    assert all(not torch.equal(p, before[n]) for n, p in m.named_parameters()), "every weight moved"
    for group in optimizer.param_groups:
        keys = {"step", "momentum_buffer"} if group["muon"] else {"step", "exp_avg", "exp_avg_sq"}
        for p in group["params"]:
            state = optimizer.state[p]
            assert set(state) == keys and state["step"].item() == 1
            assert all(state[k].any() for k in keys - {"step"})


def test_the_update_of_a_matrix_has_adamws_rms_so_one_lr_serves_both():
    """0.2·sqrt(max(rows, cols))·O has RMS ~0.2 (O's singular values ~1): an AdamW step's typical RMS."""
    w = torch.nn.Parameter(torch.zeros(48, 96))
    optimizer = Muon([{"params": [w], "muon": True}], lr=1e-2, weight_decay=0.0, momentum=0.0, ns_steps=5,
                     betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
    w.grad = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    optimizer.step()
    rms = w.detach().pow(2).mean().sqrt().item() / 1e-2
    assert 0.15 < rms < 0.22, rms
    assert rms_scale((48, 96)) == pytest.approx(0.2 * 96**0.5)


def test_nesterov_momentum_and_decoupled_decay_follow_the_formulas():
    """B ← μB + g; W ← (1 − lr·λ)W − lr·scale·NS(g + μB); with one step and B = 0 that is NS((1 + μ)g) = NS(g)."""
    w0 = torch.randn(16, 24, generator=torch.Generator().manual_seed(1))
    g = torch.randn(16, 24, generator=torch.Generator().manual_seed(2))
    w = torch.nn.Parameter(w0.clone())
    optimizer = Muon([{"params": [w], "muon": True}], lr=0.1, weight_decay=0.5, momentum=0.9, ns_steps=5,
                     betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
    w.grad = g.clone()
    optimizer.step()
    expected = (1 - 0.1 * 0.5) * w0 - 0.1 * rms_scale(w0.shape) * newton_schulz(1.9 * g, 5)
    torch.testing.assert_close(w.detach(), expected)
    torch.testing.assert_close(optimizer.state[w]["momentum_buffer"], g)
    w.grad = g.clone()
    optimizer.step()
    torch.testing.assert_close(optimizer.state[w]["momentum_buffer"], 1.9 * g)


def test_state_dict_round_trip_continues_identically():
    a = model()
    opt_a = muon_for(a)
    train_step(a, opt_a, seed=1)
    b = copy.deepcopy(a)
    opt_b = muon_for(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as saved: torch.load gives new tensors
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        for key, value in opt_a.state[pa].items():
            assert torch.equal(value, opt_b.state[pb][key])
    train_step(a, opt_a, seed=2)
    train_step(b, opt_b, seed=2)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def test_a_heal_carries_every_state_tensor_and_a_received_state_continues_identically():
    """A peer's inner state goes by ``HealState.tensors()``: every buffer and moment, and each step count."""
    sender, receiver = model(seed=0), model(seed=0)
    sent, received = muon_for(sender), muon_for(receiver)
    assert not create_state_to_fill(received), "Muon's state exists from construction"
    train_step(sender, sent, seed=1)
    heal = HealState(global_params=[list(sender.parameters())], outer_optimizers=[], inner_optimizer=sent)
    named = inner_optimizer_tensors(sent)
    assert {k for k in heal.tensors() if k.startswith("inner.")} == set(named)
    muon_params = sum(len(g["params"]) for g in sent.param_groups if g["muon"])
    adamw_params = sum(len(g["params"]) for g in sent.param_groups if not g["muon"])
    kinds = [k.split(".", 2)[2] for k in named]
    assert kinds.count("momentum_buffer") == muon_params and kinds.count("exp_avg_sq") == adamw_params
    assert kinds.count("step") == muon_params + adamw_params
    target = HealState(global_params=[list(receiver.parameters())], outer_optimizers=[], inner_optimizer=received)
    assert {k: v.shape for k, v in target.tensors().items()} == {k: v.shape for k, v in heal.tensors().items()}
    target.load_tensors({k: v.clone() for k, v in heal.tensors().items() if k.startswith("inner.")})
    with torch.no_grad():
        for pr, ps in zip(receiver.parameters(), sender.parameters(), strict=True):
            pr.copy_(ps)
    train_step(sender, sent, seed=2)
    train_step(receiver, received, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(sender.parameters(), receiver.parameters(), strict=True))


def test_muon_on_a_model_without_hidden_matrices_is_refused_in_one_line():
    weight, bias = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ConfigError, match=r"^inner_opt.name='muon': .*no 2-D weights.*use inner_opt=adamw$") as no:
        build_inner_optimizer([weight, bias], MUON, 10)
    assert "\n" not in str(no.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["inner_opt=adamw", "inner_opt.momentum=0.9"], r"^inner_opt\.momentum=0\.9 does nothing with inner_opt=adamw"),
        (["inner_opt=adamw", "inner_opt.ns_steps=3"], r"^inner_opt\.ns_steps=3 does nothing with inner_opt=adamw"),
        (["inner_opt=sgd", "inner_opt.betas=[0.8,0.9]"], r"^inner_opt\.betas=\(0\.8, 0\.9\) does nothing .*=sgd"),
        (["inner_opt=muon", "inner_opt.lr=0"], r"^inner_opt\.lr=0\.0: must be > 0"),
        (["inner_opt=muon", "inner_opt.lr=1.5"], r"^inner_opt\.lr=1\.5: must be in \(0, 1\] with inner_opt=muon"),
        (["inner_opt=muon", "inner_opt.momentum=1"], r"^inner_opt\.momentum=1\.0: must be in \[0, 1\)"),
        (["inner_opt=muon", "inner_opt.momentum=-0.1"], r"^inner_opt\.momentum=-0\.1: must be in \[0, 1\)"),
        (["inner_opt=muon", "inner_opt.ns_steps=0"], r"^inner_opt\.ns_steps=0: must be an integer >= 1"),
    ],
)
def test_bad_muon_settings_are_refused_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        compose_job(overrides)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["inner_opt=muon", "inner_opt.momentum=0.9", "inner_opt.ns_steps=6", "inner_opt.betas=[0.8,0.9]"],
        ["inner_opt=muon", "algo=ddp"],  # the data-parallel baseline with Muon
        ["inner_opt=adamw", "inner_opt.momentum=0.95"],  # the default: nothing set
    ],
)
def test_muon_settings_it_reads_pass(overrides):
    compose_job(overrides)


def test_in_a_sweep_the_keys_the_optimizer_does_not_read_are_reset_and_said_in_one_line():
    raw = compose_raw(["inner_opt=adamw", "inner_opt.momentum=0.9", "inner_opt.ns_steps=3"])
    said = KEYS_READ.reset(raw)
    assert said == (
        "inner_opt.momentum=0.9, inner_opt.ns_steps=3 do nothing with inner_opt=adamw, which does not read them; "
        "ignored in this job"
    )
    assert raw["inner_opt"]["momentum"] == 0.95 and raw["inner_opt"]["ns_steps"] == 5
    assert KEYS_READ.reset(compose_raw(["inner_opt=muon", "inner_opt.momentum=0.9"])) is None
