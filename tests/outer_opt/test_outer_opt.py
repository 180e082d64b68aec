"""Outer optimizers: registry, DiLoCo's special cases, state as named tensors, config and presets."""

from __future__ import annotations

import pytest
import torch
import yaml

import outer_opt
from diloco.config.base import ConfigError, from_dict
from diloco.outer.update import outer_update
from diloco.schedule import momentum
from outer_opt import (
    OuterOptConfig,
    available,
    build_outer_optimizer,
    initialize_state,
    load_optimizer_state_tensors,
    optimizer_state_tensors,
    register,
)
from outer_opt import registry as registry_module
from outer_opt.optimizers import InPlaceSGD
from tests.conftest import CONF_DIR

CONF = CONF_DIR / "outer_opt"
SHAPES = [(4, 3), (5,), (2, 2, 2)]


def make_params(seed: int = 0, parameter: bool = True) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*shape, generator=g) for shape in SHAPES]
    return [torch.nn.Parameter(t, requires_grad=False) if parameter else t for t in tensors]


def make_grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(*shape, generator=g) * 1e-2 for shape in SHAPES]


def step(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def cfg_for(name: str, **overrides) -> OuterOptConfig:
    """Each optimizer's yaml preset (deltas over ``OuterOptConfig()``), so every one is tested
    with the settings a user gets."""
    raw = yaml.safe_load((CONF / f"{name}.yaml").read_text()) or {}
    return from_dict(OuterOptConfig, {**raw, **overrides}, "outer_opt")


def snapshot(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in optimizer_state_tensors(opt).items()}


# --- registry ---------------------------------------------------------------------------------


def test_builtins_are_registered():
    names = available()
    assert names == sorted(names)
    assert {"nesterov", "sgd", "avg", "adam", "lamb", "adabelief", "radam", "yogi"} <= set(names)


def test_register_adds_a_builder_and_rejects_duplicates(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register("plainsgd")
    def build(params, cfg):
        return torch.optim.SGD(params, lr=cfg.lr)

    assert "plainsgd" in available()
    OuterOptConfig(name="plainsgd").validate()
    params = make_params()
    opt = build_outer_optimizer(params, OuterOptConfig(name="plainsgd", lr=0.5))
    assert isinstance(opt, torch.optim.SGD)
    with pytest.raises(ValueError, match="already registered"):
        register("plainsgd")(build)
    with pytest.raises(ValueError, match="lowercase identifier"):
        register("Bad Name")

    @register("dropsone")
    def build_bad(params, cfg):
        return torch.optim.SGD(params[1:], lr=cfg.lr)

    with pytest.raises(ValueError, match="must optimize exactly the given 3 params"):
        build_outer_optimizer(make_params(), OuterOptConfig(name="dropsone"))


@pytest.mark.parametrize("parameter", [True, False])
def test_builds_on_parameters_and_plain_tensors(parameter):
    for name in available():
        params = make_params(parameter=parameter)
        opt = build_outer_optimizer(params, cfg_for(name))
        before = [p.clone() for p in params]
        step(opt, params, make_grads(0))
        assert all(not torch.equal(a, b) for a, b in zip(before, params)), name


def test_build_rejects_bad_params():
    with pytest.raises(ValueError, match="at least one"):
        build_outer_optimizer([], OuterOptConfig())
    with pytest.raises(ValueError, match="param 1 has dtype torch.bfloat16"):
        build_outer_optimizer([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)], OuterOptConfig())
    p = torch.zeros(2)
    with pytest.raises(ValueError, match="same tensor twice"):
        build_outer_optimizer([p, p], OuterOptConfig())
    with pytest.raises(ValueError, match="not a leaf"):
        build_outer_optimizer([torch.zeros(2, requires_grad=True) * 2], OuterOptConfig())
    with pytest.raises(ConfigError, match="outer_opt.name='foo'"):
        build_outer_optimizer([torch.zeros(2)], OuterOptConfig(name="foo"))


# --- DiLoCo's special cases -------------------------------------------------------------------


def test_avg_is_parameter_averaging():
    """θ_g − mean_i(θ_g − θ_l,i) == mean_i(θ_l,i), whatever lr and momentum say."""
    theta_g = make_params(0)
    locals_ = [make_params(seed) for seed in (1, 2, 3)]
    opt = build_outer_optimizer(theta_g, OuterOptConfig(name="avg", lr=0.3, momentum=0.5, nesterov=False))
    for _ in range(2):  # also on a second round: no momentum may leak in
        with torch.no_grad():
            for i, p in enumerate(theta_g):
                p.grad = torch.stack([p - local[i] for local in locals_]).mean(dim=0)
        opt.step()
        for i, p in enumerate(theta_g):
            want = torch.stack([local[i] for local in locals_]).mean(dim=0)
            torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)
        locals_ = [[q + 0.01 * (j + 1) for q in local] for j, local in enumerate(locals_)]
    assert optimizer_state_tensors(opt) == {}


def test_nesterov_matches_closed_form():
    """DiLoCo's outer step: b_t = μ b_{t−1} + Δ_t, θ_t = θ_{t−1} − lr (Δ_t + μ b_t), b_0 = 0."""
    lr, mu = 0.7, 0.9
    theta = torch.tensor([1.0, -2.0, 0.5, 0.0])
    deltas = [
        torch.tensor([0.1, 0.2, -0.3, 0.0]),
        torch.tensor([-0.05, 0.1, 0.2, 1.0]),
        torch.tensor([0.3, 0.0, 0.1, -1.0]),
    ]
    p = torch.nn.Parameter(theta.clone(), requires_grad=False)
    opt = build_outer_optimizer([p], OuterOptConfig(name="nesterov", lr=lr, momentum=mu))
    b = [0.0] * 4
    want = theta.tolist()
    for delta in deltas:
        p.grad = delta.clone()
        opt.step()
        for j, d in enumerate(delta.tolist()):
            b[j] = mu * b[j] + d
            want[j] -= lr * (d + mu * b[j])
        torch.testing.assert_close(p.detach(), torch.tensor(want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(optimizer_state_tensors(opt)["p0.momentum_buffer"], torch.tensor(b))
    # The three steps written out for the first coordinate:
    # b = 0.1, 0.04, 0.336; θ = 1 − 0.7·(0.19 − 0.014 + 0.6024) = 0.45512
    assert abs(p[0].item() - 0.45512) < 1e-6


@pytest.mark.parametrize(
    "settings",
    [
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
        {"momentum": 0.8, "dampening": 0.3},
        {"momentum": 0.5, "maximize": True, "weight_decay": 0.01},
        {"momentum": 0.0},
    ],
    ids=["nesterov", "nesterov-wd", "heavy-ball-dampened", "maximize", "plain"],
)
def test_the_in_place_sgd_steps_torchs_sgd_bit_for_bit_and_allocates_no_direction(settings):
    """Five steps from torch's own lazy start (no momentum buffer) and grads of every sign: the same
    bits in θ and b; each step's direction is written into ``p.grad`` itself."""
    ours, theirs = make_params(3), make_params(3)
    in_place = InPlaceSGD(ours, lr=0.7, **settings)
    reference = torch.optim.SGD(theirs, lr=0.7, foreach=False, **settings)
    for seed in range(5):
        grads = make_grads(seed)
        step(reference, theirs, grads)
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        scratch = [p.grad.data_ptr() for p in ours]
        in_place.step()
        assert [p.grad.data_ptr() for p in ours] == scratch
        for a, b, g in zip(ours, theirs, grads):
            assert torch.equal(a, b)
            if settings["momentum"]:
                buf = in_place.state[a]["momentum_buffer"]
                assert torch.equal(buf, reference.state[b]["momentum_buffer"])
            if settings.get("nesterov"):  # the direction g + λ·θ + μ·b, where torch keeps it in a temporary
                assert not torch.equal(a.grad, g)


def test_sgd_is_heavy_ball_and_honours_nesterov():
    p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    opt = build_outer_optimizer([p], cfg_for("sgd"))  # preset: nesterov false
    for _ in range(2):
        p.grad = torch.ones(1)
        opt.step()
    # b = 1, 1.9; θ = −0.7·1 − 0.7·1.9
    torch.testing.assert_close(p.detach(), torch.tensor([-0.7 * 2.9]))
    assert build_outer_optimizer([torch.zeros(1)], cfg_for("sgd", nesterov=True)).param_groups[0]["nesterov"]


def test_single_group_sgd_lr1_outer_step_is_identity_on_the_inner_model():
    """M = 1, outer SGD lr 1 without momentum: θ_g ends where the group's θ_l ended."""
    theta_g = make_params(0)
    theta_l = make_params(7)
    opt = build_outer_optimizer(theta_g, OuterOptConfig(name="sgd", lr=1.0, momentum=0.0, nesterov=False))
    step(opt, theta_g, [g.detach() - local for g, local in zip(theta_g, theta_l)])
    for g, local in zip(theta_g, theta_l):
        torch.testing.assert_close(g.detach(), local, rtol=0, atol=1e-6)


# --- momentum warm-up ------------------------------------------------------------------------------


def one_round(opt: torch.optim.Optimizer, p: torch.nn.Parameter, delta: list[float], mu: float | None) -> None:
    """An outer step with Δ̄ = ``delta`` and this round's μ; θ_l (a copy of θ_g) only receives it."""
    outer_update([p], [p.detach().clone()], torch.tensor(delta), opt, alpha=0.0, momentum=mu)


def test_momentum_warmup_steps_the_closed_form():
    """b_t = μ_t b_{t−1} + Δ_t, θ_t = θ_{t−1} − lr (Δ_t + μ_t b_t), with μ_t = μ(s) of each round's launch step."""
    lr, mu, warmup_steps = 0.7, 0.9, 30
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0]), requires_grad=False)
    opt = build_outer_optimizer([p], OuterOptConfig(name="nesterov", lr=lr, momentum=mu))
    b, want = [0.0, 0.0], [1.0, -1.0]
    for launch_step, delta in ((10, [0.5, 0.1]), (20, [0.4, -0.2]), (30, [0.3, 0.3]), (40, [0.1, 0.0])):
        one_round(opt, p, delta, momentum(launch_step, mu, warmup_steps))
        assert opt.param_groups[0]["momentum"] == pytest.approx(mu * min(1.0, launch_step / warmup_steps))
        mu_t = mu * min(1.0, launch_step / warmup_steps)
        for j, d in enumerate(delta):
            b[j] = mu_t * b[j] + d
            want[j] -= lr * (d + mu_t * b[j])
        torch.testing.assert_close(p.detach(), torch.tensor(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["avg", "adam"])
def test_a_rounds_momentum_leaves_optimizers_without_one_alone(name):
    """``avg`` keeps its momentum of 0 (its μ(s) is 0) and the Adam family gets no momentum key."""
    p = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    opt = build_outer_optimizer([p], cfg_for(name))
    full = opt.param_groups[0].get("momentum")
    before = [dict(group, params=None) for group in opt.param_groups]
    one_round(opt, p, [0.1, 0.2], None if full is None else momentum(10, full, 100))
    assert [dict(group, params=None) for group in opt.param_groups] == before


def test_momentum_warmup_steps_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"outer_opt.momentum_warmup_steps=-1: must be >= 0"):
        OuterOptConfig(momentum_warmup_steps=-1).validate()


# --- eager state, names, round trip --------------------------------------------------------------


@pytest.mark.parametrize("name", available())
def test_state_names_are_stable_across_steps(name):
    params = make_params()
    opt = build_outer_optimizer(params, cfg_for(name))
    fresh = optimizer_state_tensors(opt)
    step(opt, params, make_grads(0))
    stepped = optimizer_state_tensors(opt)
    assert list(fresh) == list(stepped)
    for key in fresh:
        assert fresh[key].dtype == stepped[key].dtype and fresh[key].shape == stepped[key].shape, key
    assert all(key.split(".", 1)[0] in {"p0", "p1", "p2"} for key in fresh)


@pytest.mark.parametrize("name", available())
def test_eager_state_matches_the_optimizers_own_lazy_init(name):
    """Creating the state up front changes nothing: same parameters after three steps."""
    eager_params, lazy_params = make_params(), make_params()
    eager = build_outer_optimizer(eager_params, cfg_for(name, weight_decay=0.01))
    lazy = build_outer_optimizer(lazy_params, cfg_for(name, weight_decay=0.01))
    lazy.state.clear()  # as torch would have it before the first step
    for t in range(3):
        step(eager, eager_params, make_grads(t))
        step(lazy, lazy_params, make_grads(t))
    for a, b in zip(eager_params, lazy_params):
        assert torch.equal(a, b), name
    assert list(optimizer_state_tensors(eager)) == list(optimizer_state_tensors(lazy))
    for key, value in optimizer_state_tensors(lazy).items():
        assert torch.equal(value, optimizer_state_tensors(eager)[key]), key


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", available())
def test_state_round_trip_gives_bit_identical_next_step(name, weight_decay):
    cfg = cfg_for(name, weight_decay=weight_decay)
    params_a = make_params()
    opt_a = build_outer_optimizer(params_a, cfg)
    for t in range(3):
        step(opt_a, params_a, make_grads(t))

    # A healing group: its θ_g is overwritten with the peer's, then the optimizer state.
    params_b = make_params(seed=99)
    opt_b = build_outer_optimizer(params_b, cfg)
    with torch.no_grad():
        for a, b in zip(params_a, params_b):
            b.copy_(a)
    sent = snapshot(opt_a)
    load_optimizer_state_tensors(opt_b, sent)
    received = optimizer_state_tensors(opt_b)
    assert list(received) == list(sent)
    assert all(torch.equal(received[k], sent[k]) and received[k].dtype == sent[k].dtype for k in sent)

    for t in (3, 4):
        step(opt_a, params_a, make_grads(t))
        step(opt_b, params_b, make_grads(t))
        for a, b in zip(params_a, params_b):
            assert torch.equal(a, b), (name, t)
        after_a, after_b = optimizer_state_tensors(opt_a), optimizer_state_tensors(opt_b)
        assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)


def snapshot_dict(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in d.items()}


def test_loading_does_not_alias_the_sent_tensors():
    params = make_params()
    opt = build_outer_optimizer(params, cfg_for("adam"))
    step(opt, params, make_grads(0))
    sent = snapshot(opt)
    frozen = snapshot_dict(sent)
    other_params = make_params()
    other = build_outer_optimizer(other_params, cfg_for("adam"))
    load_optimizer_state_tensors(other, sent)
    step(other, other_params, make_grads(1))
    assert all(torch.equal(sent[k], frozen[k]) for k in sent)


def test_scalar_state_travels_as_exact_tensors():
    params = make_params()
    opt = build_outer_optimizer(params, cfg_for("adabelief"))
    for t in range(2):
        step(opt, params, make_grads(t))
    state = optimizer_state_tensors(opt)
    assert state["p0.step"].dtype == torch.int64 and state["p0.step"].item() == 2
    assert state["p0.rho_inf"].dtype == torch.float64 and state["p0.rho_inf"].item() == 2.0 / (1 - 0.999) - 1.0
    adam = build_outer_optimizer(make_params(), cfg_for("adam"))
    assert optimizer_state_tensors(adam)["p0.step"].dtype == torch.float32


def test_lamb_diagnostics_are_not_state():
    params = make_params()
    opt = build_outer_optimizer(params, cfg_for("lamb"))
    step(opt, params, make_grads(0))
    assert "trust_ratio" in opt.state[params[0]]
    assert not any(k.endswith(("trust_ratio", "weight_norm", "adam_norm")) for k in optimizer_state_tensors(opt))


def test_load_rejects_mismatched_state():
    params = make_params()
    opt = build_outer_optimizer(params, cfg_for("adam"))
    good = snapshot(opt)
    with pytest.raises(ValueError, match=r"missing \['p0.exp_avg'\]"):
        load_optimizer_state_tensors(opt, {k: v for k, v in good.items() if k != "p0.exp_avg"})
    with pytest.raises(ValueError, match=r"unexpected \['p9.exp_avg'\]"):
        load_optimizer_state_tensors(opt, {**good, "p9.exp_avg": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"p0.exp_avg: got torch.float32 \(3, 4\), expected torch.float32 \(4, 3\)"):
        load_optimizer_state_tensors(opt, {**good, "p0.exp_avg": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="p0.exp_avg: got torch.float64"):
        load_optimizer_state_tensors(opt, {**good, "p0.exp_avg": torch.zeros(4, 3, dtype=torch.float64)})
    lamb = build_outer_optimizer(make_params(), cfg_for("lamb"))
    lamb_state = snapshot(lamb)
    with pytest.raises(ValueError, match="p1.step: got torch.float32"):
        load_optimizer_state_tensors(lamb, {**lamb_state, "p1.step": torch.tensor(3.0)})
    # A failed load leaves the optimizer untouched.
    bad = {**good, "p0.exp_avg": torch.ones(4, 3), "p2.exp_avg": torch.zeros(1)}
    with pytest.raises(ValueError):
        load_optimizer_state_tensors(opt, bad)
    assert torch.equal(optimizer_state_tensors(opt)["p0.exp_avg"], torch.zeros(4, 3))


def test_initialize_state_is_what_builders_use():
    p = torch.zeros(3)
    opt = initialize_state(
        torch.optim.SGD([p], lr=0.1, momentum=0.5), lambda q, g: {"momentum_buffer": torch.ones_like(q)}
    )
    assert torch.equal(optimizer_state_tensors(opt)["p0.momentum_buffer"], torch.ones(3))


# --- config -------------------------------------------------------------------------------------


def message(**fields) -> str:
    with pytest.raises(ConfigError) as info:
        OuterOptConfig(**fields).validate()
    return str(info.value)


def test_defaults_are_dilocos():
    cfg = OuterOptConfig()
    cfg.validate()
    assert (cfg.name, cfg.lr, cfg.momentum, cfg.nesterov, cfg.eps) == ("nesterov", 0.7, 0.9, True, 0.1)
    opt = build_outer_optimizer([torch.zeros(2)], cfg)
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.SGD) and group["nesterov"] and group["lr"] == 0.7 and group["momentum"] == 0.9


def test_validation_messages():
    msg = message(name="foo")
    assert msg == f"outer_opt.name='foo': must be one of {', '.join(available())}; add one with outer_opt.register"
    assert msg.startswith("outer_opt.name='foo': must be one of adabelief, adam, avg, ")
    assert message(lr=0.0) == "outer_opt.lr=0.0: must be > 0"
    assert message(lr=float("nan")).startswith("outer_opt.lr=nan")
    assert message(momentum=1.0) == "outer_opt.momentum=1.0: must be in [0, 1)"
    assert message(betas=(0.9, 1.0)) == "outer_opt.betas[1]=1.0: must be in [0, 1)"
    assert message(eps=0.0).startswith("outer_opt.eps=0.0: must be > 0")
    assert message(weight_decay=-1.0) == "outer_opt.weight_decay=-1.0: must be >= 0"
    assert "use outer_opt=sgd" in message(nesterov=False)
    assert message(name="sgd", momentum=0.0).startswith("outer_opt.momentum=0.0: Nesterov momentum needs")
    OuterOptConfig(name="sgd", momentum=0.0, nesterov=False).validate()
    OuterOptConfig(name="avg", momentum=0.0).validate()


def test_from_dict_names_the_key():
    with pytest.raises(ConfigError, match=r"outer_opt.betas=\[0.9\]: must be a list of 2 values"):
        from_dict(OuterOptConfig, {"betas": [0.9]}, "outer_opt")


def test_every_registered_optimizer_has_a_valid_preset():
    presets = sorted(path.stem for path in CONF.glob("*.yaml"))
    assert set(available()) <= set(presets), "each registered optimizer needs conf/outer_opt/<name>.yaml"
    fields = set(OuterOptConfig.__dataclass_fields__)
    for stem in presets:
        text = (CONF / f"{stem}.yaml").read_text()
        assert text.startswith("# "), stem
        raw = yaml.safe_load(text) or {}
        assert set(raw) <= fields, stem
        cfg = from_dict(OuterOptConfig, raw, "outer_opt")
        assert cfg.name == stem
        cfg.validate()


def test_package_exports():
    assert set(outer_opt.__all__) >= {
        "OuterOptConfig",
        "available",
        "build_outer_optimizer",
        "load_optimizer_state_tensors",
        "optimizer_state_tensors",
        "register",
    }
