"""The inner learning-rate schedule: linear warmup, then cosine to min_lr_ratio."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.config.inner_opt import InnerOptConfig
from diloco.train.inner_opt import build_inner_optimizer, lr_multiplier


def test_warmup_is_linear_and_starts_above_zero():
    values = [lr_multiplier(s, warmup_steps=4, max_steps=20, min_lr_ratio=0.1) for s in range(4)]
    assert values == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_cosine_reaches_min_ratio_at_the_last_step():
    kw = dict(warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    assert lr_multiplier(4, **kw) == pytest.approx(1.0)
    assert lr_multiplier(19, **kw) == pytest.approx(0.1)
    midpoint = 4 + (20 - 4 - 1) / 2
    assert lr_multiplier(int(midpoint), **kw) > lr_multiplier(int(midpoint) + 1, **kw)
    assert all(lr_multiplier(s, **kw) >= lr_multiplier(s + 1, **kw) for s in range(4, 19)), (
        "cosine decay must be monotone"
    )


def test_no_warmup_starts_at_peak():
    assert lr_multiplier(0, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == 1.0
    assert math.isclose(lr_multiplier(9, warmup_steps=0, max_steps=10, min_lr_ratio=0.0), 0.0, abs_tol=1e-12)


def test_scheduler_drives_optimizer_lr_and_skips_decay_on_vectors():
    weight = torch.nn.Parameter(torch.ones(2, 2))
    bias = torch.nn.Parameter(torch.ones(2))
    cfg = InnerOptConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.0)
    optimizer, scheduler = build_inner_optimizer([weight, bias], cfg, max_steps=6)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[:2] == pytest.approx([0.5, 1.0])
    assert seen[-1] == pytest.approx(0.0, abs=1e-12)
