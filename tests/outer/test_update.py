"""The outer update's closed forms on plain CPU tensors: no lighthouse, no process group.

Each group m holds its own copy of θ_g and of the outer optimizer, as workers do; ``lane_mean``
stands in for the all-reduce: it sums w_m·Δ_m and w_m over the groups and hands the sums to
``weighted_mean``, as ``reduce.launch_reduce`` has the lane do. Values that are multiples of
1/8 keep every sum and every division by M ∈ {2, 4} exact, so those tests use ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch

from diloco.outer.update import (
    contribution_weight,
    global_copy,
    outer_update,
    pseudo_gradient,
    reset_local,
    weighted_mean,
)
from diloco.schedule import momentum
from outer_opt import OuterOptConfig, build_outer_optimizer

SHAPES = [(3, 4), (5,)]
NESTEROV = OuterOptConfig(name="nesterov", lr=0.7, momentum=0.9, momentum_warmup_steps=0)
PLAIN_SGD = OuterOptConfig(name="sgd", lr=1.0, momentum=0.0, nesterov=False, momentum_warmup_steps=0)


def eighths(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Tensors of the fragment's shapes holding multiples of 1/8 in [−2, 2)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(-16, 16, shape, generator=gen) / 8).to(dtype) for shape in SHAPES]


def normals(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def lane_mean(deltas: list[torch.Tensor], weights: list[float]) -> torch.Tensor | None:
    """Δ̄ as the lane computes it: Σ_m w_m·Δ_m and Σ_m w_m, then ``weighted_mean``."""
    return weighted_mean(sum(d * w for d, w in zip(deltas, weights)), sum(weights))


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def test_pseudo_gradient_is_global_minus_local_flattened_in_fp32():
    theta_g = global_copy(eighths(0), pin_memory=False)
    theta_l = eighths(1, torch.bfloat16)
    delta = pseudo_gradient(theta_g, theta_l)
    assert delta.dtype == torch.float32 and not delta.requires_grad
    assert torch.equal(delta, flat(theta_g) - flat(theta_l).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # cast first, or one pass
def test_pseudo_gradient_into_a_staging_buffer_has_the_same_bits_and_leaves_the_room_behind_it(dtype):
    theta_g = global_copy(normals(0), pin_memory=False)
    theta_l = [t.to(dtype) for t in normals(1)]
    numel = sum(t.numel() for t in theta_g)
    staging = torch.full((numel + 4,), 7.0)
    delta = pseudo_gradient(theta_g, theta_l, staging)
    assert delta.data_ptr() == staging.data_ptr() and delta.numel() == numel
    assert torch.equal(delta, pseudo_gradient(theta_g, theta_l))
    assert torch.equal(staging[numel:], torch.full((4,), 7.0))


def test_global_copy_is_an_fp32_cpu_copy_that_does_not_share_the_model_storage():
    theta_l = eighths(0, torch.bfloat16)
    theta_g = global_copy(theta_l, pin_memory=False)
    assert all(isinstance(g, torch.nn.Parameter) and g.dtype == torch.float32 for g in theta_g)
    assert torch.equal(flat(theta_g), flat(theta_l).float())
    theta_l[0].add_(1)
    assert not torch.equal(theta_g[0].detach(), theta_l[0].float())


@pytest.mark.parametrize("cfg", [OuterOptConfig(name="avg"), PLAIN_SGD], ids=["avg", "sgd-lr1"])
@pytest.mark.parametrize("groups", [2, 4])
def test_outer_sgd_lr1_without_momentum_is_parameter_averaging(cfg, groups):
    """θ_g − Δ̄ = θ_g − mean_m(θ_g − θ_l,m) = mean_m θ_l,m, and with α = 0 every group takes it."""
    start = eighths(0)
    theta_l = [eighths(10 + m) for m in range(groups)]
    mean_delta = lane_mean([pseudo_gradient(start, local) for local in theta_l], [1.0] * groups)
    thetas_g = []
    for local in theta_l:  # each group steps its own θ_g with the same Δ̄
        theta_g = global_copy(start, pin_memory=False)
        outer_update(theta_g, local, mean_delta, build_outer_optimizer(theta_g, cfg), alpha=0.0)
        thetas_g.append(theta_g)
    average = [sum(ls) / groups for ls in zip(*theta_l)]
    for theta_g, local in zip(thetas_g, theta_l):
        assert torch.equal(flat(theta_g), flat(average))
        assert torch.equal(flat(local), flat(average))


def test_outer_sgd_lr1_averages_three_groups_to_float_tolerance():
    start, theta_l = normals(0), [normals(1 + m) for m in range(3)]
    theta_g = global_copy(start, pin_memory=False)
    mean_delta = lane_mean([pseudo_gradient(theta_g, local) for local in theta_l], [1.0] * 3)
    average = [sum(ls) / 3 for ls in zip(*theta_l)]
    outer_update(theta_g, theta_l[0], mean_delta, build_outer_optimizer(theta_g, PLAIN_SGD), alpha=0.0)
    torch.testing.assert_close(flat(theta_g), flat(average), rtol=0, atol=1e-6)


@pytest.mark.parametrize("warmup_steps", [0, 12], ids=["constant-mu", "mu-warmup"])
def test_nesterov_over_three_rounds_matches_the_closed_form(warmup_steps):
    """DiLoCo (α = 0), two groups, H = 5: torch's Nesterov SGD, written out in fp64.

    v ← μ_r·v + Δ̄;  θ_g ← θ_g − lr·(Δ̄ + μ_r·v), with μ_r = μ·min(1, s_r/W) under a warm-up
    over W inner steps (s_r: the round's launch step) and μ_r = μ without one.
    """
    lr, mu, groups = NESTEROV.lr, NESTEROV.momentum, 2
    theta_g = global_copy(normals(0), pin_memory=False)
    optimizer = build_outer_optimizer(theta_g, NESTEROV)
    want_g = flat(theta_g).double()
    v = torch.zeros_like(want_g)
    theta_l = [[g.detach().clone() for g in theta_g] for _ in range(groups)]
    for r, launch_step in enumerate((5, 10, 15)):
        for m, local in enumerate(theta_l):  # the inner steps: each group drifts its own way
            for t, drift in zip(local, normals(100 * r + m)):
                t.add_(0.1 * drift)
        mean_delta = lane_mean([pseudo_gradient(theta_g, local) for local in theta_l], [1.0] * groups)
        want_delta = sum(want_g - flat(local).double() for local in theta_l) / groups
        mu_r = momentum(launch_step, mu, warmup_steps) if warmup_steps else None
        outer_update(theta_g, theta_l[0], mean_delta, optimizer, alpha=0.0, momentum=mu_r)
        reset_local(theta_g, theta_l[1])  # group 1 takes the same step: here it shares group 0's θ_g
        mu_r = mu * min(1.0, launch_step / warmup_steps) if warmup_steps else mu
        v = mu_r * v + want_delta
        want_g = want_g - lr * (want_delta + mu_r * v)
        torch.testing.assert_close(flat(theta_g).double(), want_g, rtol=0, atol=1e-5, msg=f"θ_g, round {r}")
        buffers = flat([optimizer.state[g]["momentum_buffer"] for g in theta_g]).double()
        torch.testing.assert_close(buffers, v, rtol=0, atol=1e-5, msg=f"v, round {r}")
        for local in theta_l:
            assert torch.equal(flat(local), flat(theta_g)), "α = 0: every group restarts from θ_g"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 1.0])
def test_mixing_keeps_alpha_of_the_local_model(alpha, dtype):
    """θ_l ← α·θ_l + (1 − α)·θ_g after the outer step, in θ_l's dtype: α = 0 resets, α = 1 keeps θ_l."""
    theta_g = global_copy(normals(0), pin_memory=False)
    theta_l = [t.to(dtype) for t in normals(1)]
    before = [t.clone() for t in theta_l]
    mean_delta = pseudo_gradient(theta_g, theta_l)
    outer_update(theta_g, theta_l, mean_delta, build_outer_optimizer(theta_g, NESTEROV), alpha)
    new_g = [g.detach().to(dtype) for g in theta_g]
    assert all(t.dtype == dtype for t in theta_l)
    if alpha == 0.0:
        assert torch.equal(flat(theta_l), flat(new_g))
    elif alpha == 1.0:
        assert torch.equal(flat(theta_l), flat(before))
    else:
        assert torch.equal(flat(theta_l), flat([alpha * b + (1 - alpha) * g for b, g in zip(before, new_g)]))
    exact = alpha * flat(before).double() + (1 - alpha) * flat(theta_g).double()
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(flat(theta_l).double(), exact, rtol=0, atol=tolerance)


def test_reset_local_takes_theta_g_without_a_step():
    theta_g = global_copy(normals(0), pin_memory=False)
    theta_l = [t.to(torch.bfloat16) for t in normals(1)]
    reset_local(theta_g, theta_l)
    assert torch.equal(flat(theta_l), flat(theta_g).to(torch.bfloat16))
    assert torch.equal(flat(theta_g), flat(normals(0)))


def test_uniform_weighting_is_the_plain_mean_over_groups():
    deltas = [flat(eighths(m)) for m in range(4)]
    weights = [contribution_weight("uniform", tokens) for tokens in (3, 100, 7, 1)]
    assert weights == [1.0] * 4
    assert torch.equal(lane_mean(deltas, weights), sum(deltas) / 4)


def test_token_weighting_weighs_each_group_by_its_tokens():
    """Δ̄ = Σ_m t_m·Δ_m / Σ_m t_m; equal token counts give the plain mean."""
    deltas = [flat(eighths(m)) for m in range(2)]
    weights = [contribution_weight("tokens", tokens) for tokens in (1, 3)]
    assert weights == [1.0, 3.0]
    assert torch.equal(lane_mean(deltas, weights), (deltas[0] + 3 * deltas[1]) / 4)
    equal = lane_mean(deltas, [contribution_weight("tokens", 7)] * 2)
    torch.testing.assert_close(equal, (deltas[0] + deltas[1]) / 2, rtol=0, atol=1e-6)  # rounded through 7·Δ


def test_a_group_with_weight_zero_leaves_the_others_mean_untouched_and_none_contributing_gives_none():
    """A healing group or a non-finite Δ joins with zeros and w = 0 (docs/design.md, invariants 3 and 4)."""
    deltas = [flat(normals(m)) for m in range(2)]
    with_healer = lane_mean([*deltas, torch.zeros_like(deltas[0])], [1.0, 1.0, 0.0])
    assert torch.equal(with_healer, lane_mean(deltas, [1.0, 1.0]))
    assert weighted_mean(torch.zeros(4), 0.0) is None


def test_a_mean_of_the_wrong_size_is_refused():
    theta_g = global_copy(normals(0), pin_memory=False)
    optimizer = build_outer_optimizer(theta_g, NESTEROV)
    with pytest.raises(AssertionError, match="Δ̄ has 3 values, θ_g 17"):
        outer_update(theta_g, normals(1), torch.zeros(3), optimizer, alpha=0.0)
