"""Misusing ``DiLoCo`` gets one line that says what is wrong and what to do, before any round runs
where it can: a user's loop is not the job's launcher, whose checks would otherwise catch it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diloco import DiLoCo
from diloco.config.base import ConfigError
from diloco.config.model import ModelConfig
from diloco.ft.manager import MembershipError
from diloco.train.model import Transformer
from tests.library.conftest import QUICK_RULES

# Where a check comes before any contact, the lighthouse need not exist.
NOWHERE = {"DILOCO_LIGHTHOUSE": "http://127.0.0.1:9", "DILOCO_GROUP": "0"}
ALONE = {"expected_groups": 1, "end_timeout_s": 5.0}  # a job of one group: rounds and its end at once


def model_and_optimizer(out_features: int = 4) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, out_features)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def one_line(error: pytest.ExceptionInfo, *parts: str) -> str:
    """The error's message, held to being one line that contains every one of ``parts``."""
    message = str(error.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message
    return message


def test_wrapping_after_the_optimizer_stepped():
    model, optimizer = model_and_optimizer()
    inner_step(model, optimizer)
    with pytest.raises(ConfigError) as error:
        DiLoCo(model, optimizer, max_steps=10, sync_every=5, environ=NOWHERE)
    one_line(error, "the inner optimizer has stepped already", "before the first optimizer.step()")


def test_an_optimizer_state_made_ahead_of_the_first_step_is_fresh():
    """The project's own inner optimizer creates AdamW's state before any step (a heal needs its
    tensors): that is no step taken, and a construction that failed later leaves it fresh too."""
    model = nn.Linear(4, 4)
    made_ahead = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        torch.optim.AdamW(model.parameters()),
        torch.optim.Adagrad(model.parameters()),  # its state exists from its construction on
    )
    for optimizer in made_ahead:
        with pytest.raises(ConfigError):
            DiLoCo(model, optimizer, max_steps=10, sync_every=5, algo="ddp", environ=NOWHERE)
        DiLoCo(model, optimizer, max_steps=10, sync_every=5, environ=NOWHERE).sync.close()


def test_an_optimizer_missing_some_parameters():
    model, _ = model_and_optimizer()
    optimizer = torch.optim.AdamW([model.weight])
    with pytest.raises(ConfigError) as error:
        DiLoCo(model, optimizer, max_steps=10, sync_every=5, environ=NOWHERE)
    one_line(error, "does not update 1 of the model's parameters (first: bias)")


def test_no_lighthouse_address():
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError) as error:
        DiLoCo(model, optimizer, max_steps=10, sync_every=5, environ={"DILOCO_GROUP": "0"})
    one_line(error, "no lighthouse for DiLoCo", "DILOCO_LIGHTHOUSE")


@pytest.mark.parametrize("value", ["", "one", "-1", "1.5"])
def test_a_bad_group(value):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError) as error:
        DiLoCo(model, optimizer, max_steps=10, sync_every=5, environ=NOWHERE | {"DILOCO_GROUP": value})
    one_line(error, f"DILOCO_GROUP={value!r}", "an integer >= 0")
    with pytest.raises(ConfigError) as error:
        DiLoCo(model, optimizer, max_steps=10, sync_every=5, group=-1, environ=NOWHERE)
    one_line(error, "group=-1", "must be an integer >= 0")


def test_an_unknown_algo_key():
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError) as error:
        DiLoCo(model, optimizer, max_steps=10, sync_evry=10, environ=NOWHERE)
    one_line(error, "DiLoCo got sync_evry=..., which is not an AlgoConfig key", "sync_every")


@pytest.mark.parametrize("name", ["ddp", "local"])
def test_an_algo_the_job_has_but_ones_own_loop_has_not(name):
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError) as error:
        DiLoCo(model, optimizer, max_steps=10, sync_every=5, algo=name, environ=NOWHERE)
    one_line(error, f"algo={name!r}: must be one of diloco, streaming")


def test_fragments_on_a_model_without_numbered_blocks():
    model, optimizer = model_and_optimizer()
    with pytest.raises(ConfigError) as error:
        DiLoCo(model, optimizer, max_steps=10, algo="streaming", sync_every=5, fragments=2, environ=NOWHERE)
    one_line(error, "algo.fragments=2: the model has no numbered blocks", "use fragments=1")


def test_after_inner_step_outside_the_block():
    model, optimizer = model_and_optimizer()
    outer = DiLoCo(model, optimizer, max_steps=10, sync_every=5, environ=NOWHERE)
    with pytest.raises(RuntimeError) as error:
        outer.after_inner_step()
    one_line(error, "after_inner_step outside the with-block")
    outer.sync.close()


@pytest.mark.slow
def test_after_inner_step_past_max_steps_and_after_the_block(lighthouse):
    server = lighthouse(**ALONE)
    model, optimizer = model_and_optimizer()
    outer = DiLoCo(model, optimizer, max_steps=2, sync_every=1, lighthouse=server.url, group=0)
    with pytest.raises(RuntimeError) as error, outer:
        while not outer.done:
            inner_step(model, optimizer)
            outer.after_inner_step()
        outer.after_inner_step()
    one_line(error, "after_inner_step past max_steps=2", "while not outer.done:")

    server = lighthouse(**ALONE)  # a new job: the first one's group left it without finishing
    model, optimizer = model_and_optimizer()
    with DiLoCo(model, optimizer, max_steps=2, sync_every=1, lighthouse=server.url, group=0) as outer:
        while not outer.done:
            inner_step(model, optimizer)
            outer.after_inner_step()
    with pytest.raises(RuntimeError) as error:
        outer.after_inner_step()
    one_line(error, "after_inner_step outside the with-block")


@pytest.mark.slow
def test_leaving_the_block_before_done(lighthouse):
    server = lighthouse(**ALONE)
    model, optimizer = model_and_optimizer()
    outer = DiLoCo(model, optimizer, max_steps=4, sync_every=2, lighthouse=server.url, group=0)
    with pytest.raises(RuntimeError) as error, outer:
        inner_step(model, optimizer)
        outer.after_inner_step()
    one_line(error, "left the DiLoCo block at inner step 1 of max_steps=4", "while not outer.done:")


def blocks(width: int, names: str = "layers") -> nn.Module:
    """A model of two numbered blocks, as Streaming DiLoCo splits models."""
    torch.manual_seed(0)
    return nn.ModuleDict({names: nn.ModuleDict({str(i): nn.Linear(width, width) for i in range(2)})})


@pytest.mark.slow
@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: blocks(4, names="blocks"), id="names"),
        pytest.param(lambda: blocks(5), id="shapes"),
        pytest.param(lambda: Transformer(ModelConfig()), id="model"),
    ],
)
def test_a_group_whose_model_differs_from_the_first_groups_is_refused(other, lighthouse):
    """The first group pins the job's model signature (its parameters' names and shapes); a group
    with another model is refused as it enters, with the lighthouse's reason on one line."""
    server = lighthouse(QUICK_RULES, expected_groups=0)  # the first group's round forms without the second
    first = blocks(4)
    first_opt = torch.optim.AdamW(first.parameters())
    settings = {"max_steps": 4, "algo": "streaming", "sync_every": 2, "fragments": 2, "lighthouse": server.url}
    with DiLoCo(first, first_opt, group=0, **settings) as outer:
        model = other()
        refused = DiLoCo(model, torch.optim.AdamW(model.parameters()), group=1, **settings)
        with pytest.raises(MembershipError) as error, refused:
            pass
        one_line(error, "the lighthouse refused group group1: model signature", "differs from the job's")
        while not outer.done:
            inner_step_blocks(first, first_opt)
            outer.after_inner_step()
    assert outer.result is not None and outer.result.holds_final_model


def reseeded(width: int) -> nn.Module:
    model = blocks(width)
    torch.manual_seed(1)
    for p in model.parameters():
        nn.init.normal_(p)
    return model


@pytest.mark.slow
@pytest.mark.parametrize(
    "other, key",
    [
        pytest.param(lambda: (reseeded(4), {}), "initial_weights", id="another-seed"),
        pytest.param(lambda: (blocks(4), {"sync_every": 4}), "algo.sync_every", id="other-settings"),
    ],
)
def test_a_group_that_starts_from_other_weights_or_runs_other_settings_is_refused_by_key(other, key, lighthouse):
    """Same model, but another seed or another H: the lighthouse names the key that differs (groups
    built from different seeds would each keep their own model and still finish)."""
    server = lighthouse(QUICK_RULES, expected_groups=0)
    first = blocks(4)
    first_opt = torch.optim.AdamW(first.parameters())
    settings = {"max_steps": 4, "sync_every": 2, "lighthouse": server.url}
    with DiLoCo(first, first_opt, group=0, **settings) as outer:
        model, changed = other()
        refused = DiLoCo(model, torch.optim.AdamW(model.parameters()), group=1, **(settings | changed))
        with pytest.raises(MembershipError) as error, refused:
            pass
        one_line(error, "the group's training configuration differs from the job's in 1 key(s)", f"{key}: job")
        while not outer.done:
            inner_step_blocks(first, first_opt)
            outer.after_inner_step()
    assert outer.result is not None and outer.result.holds_final_model


def inner_step_blocks(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.ones(2, 4)
    for layer in model["layers"].values():
        x = layer(x)
    x.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
