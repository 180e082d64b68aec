"""A never-stepped inner optimizer gets state to receive a peer's into, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diloco.ft.state import create_state_to_fill, inner_optimizer_tensors


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5),
        lambda ps: torch.optim.NAdam(ps, lr=0.1),
    ],
    ids=["adamw", "sgd-momentum", "nadam"],
)
def test_a_fresh_optimizer_gets_every_state_tensor_and_the_weights_stay(make):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make(model.parameters())
    assert inner_optimizer_tensors(optimizer) == {}
    assert create_state_to_fill(optimizer)
    named = inner_optimizer_tensors(optimizer)
    assert {name.split(".")[1] for name in named} == {"0", "1", "2", "3"}  # every parameter has its state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not create_state_to_fill(optimizer)  # it has state now: left alone
