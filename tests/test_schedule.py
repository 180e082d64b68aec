"""The outer schedule's one window rule (diloco/schedule.py), as each of its readers applies it:
config validation, the fragments' launch/apply steps and the performance model's ``SyncPlan``."""

from __future__ import annotations

import itertools

import pytest

from diloco.config.algo import validate_schedule
from diloco.config.base import ConfigError
from diloco.outer.perf_model import SyncPlan
from diloco.schedule import (
    SyncWarmup,
    WindowProblem,
    fragments_to_apply,
    mixing_alpha,
    momentum,
    sync_warmup_window,
    window_problem,
)


def refuses(reader, *args, **keys) -> bool:
    try:
        reader(*args, **keys)
    except (ConfigError, ValueError):
        return True
    return False


def test_every_reader_refuses_exactly_the_windows_the_rule_refuses():
    disagree = []
    for H, P, tau in itertools.product(range(13), range(7), range(-1, 7)):
        refused = {
            refuses(validate_schedule, sync_every=H, fragments=P, delay=tau, alpha=0.5, n_blocks=12),
            refuses(fragments_to_apply, 1, H, P, tau),
            refuses(SyncPlan, sync_every=H, fragments=P, overlap_steps=tau),
        }
        if refused != {window_problem(H, P, tau) is not None}:
            disagree.append((H, P, tau))
    assert not disagree, disagree


def test_the_first_broken_rule_is_named():
    assert window_problem(0, 0, -1) is WindowProblem.H_BELOW_ONE
    assert window_problem(12, 0, -1) is WindowProblem.P_BELOW_ONE
    assert window_problem(12, 5, -1) is WindowProblem.P_NOT_DIVIDING_H
    assert window_problem(12, 3, -1) is WindowProblem.TAU_NEGATIVE
    assert window_problem(12, 3, 4) is WindowProblem.TAU_NOT_BELOW_SPACING
    assert window_problem(12, 3, 3) is None


def test_the_warmup_window_obeys_the_rule_in_its_short_windows():
    assert sync_warmup_window(100, 4, 1, 10, 500) == SyncWarmup(20, 500), "10 is not P's multiple"
    assert sync_warmup_window(100, 2, 5, 10, 500) == (20, 500), "τ < H₀/P"
    assert sync_warmup_window(30, 1, 0, 10, 500) == (10, 510), "W in whole H windows"
    assert sync_warmup_window(12, 1, 0, 10, 500) is None
    assert sync_warmup_window(50, 1, 0, 10, 0) is None


def test_momentum_ramps_from_the_first_step():
    assert [momentum(s, 0.9, 100) for s in (0, 1, 50, 100, 400)] == pytest.approx([0.009, 0.009, 0.45, 0.9, 0.9])


# --- mixing α: warm-up and the number of groups ---------------------------------------------


def test_alpha_without_warmup_is_the_configured_alpha_from_the_first_round():
    assert [mixing_alpha(s, 2, 0.5, 0, 0) for s in (1, 50, 10_000)] == [0.5, 0.5, 0.5]


def test_alpha_warmup_ramps_linearly_with_the_launch_step_then_holds():
    assert [mixing_alpha(s, 2, 0.5, 1000, 0) for s in (250, 500, 1000, 4000)] == [0.125, 0.25, 0.5, 0.5]
    assert mixing_alpha(0, 2, 0.5, 1000, 0) == mixing_alpha(1, 2, 0.5, 1000, 0) == 0.0005, "step 0 mixes like step 1"
    assert mixing_alpha(500, 2, 0.0, 1000, 0) == 0.0


def test_alpha_falls_as_the_square_of_reference_over_groups_beyond_the_reference_count():
    assert [mixing_alpha(1000, m, 0.5, 0, 2) for m in (1, 2, 4, 8)] == [0.5, 0.5, 0.125, 0.03125]
    assert mixing_alpha(1000, 3, 0.5, 0, 2) == pytest.approx(0.5 * 4 / 9)
    assert mixing_alpha(500, 4, 0.5, 1000, 2) == 0.0625, "the ramp and the groups' factor multiply"
    assert [mixing_alpha(1000, m, 0.5, 0, 0) for m in (1, 2, 4, 8)] == [0.5] * 4
