"""Streaming DiLoCo fragments: block partitions, parameter ownership, the staggered schedule, validation."""

from __future__ import annotations

import itertools

import pytest

from diloco.config.algo import AlgoConfig, validate_schedule
from diloco.config.base import ConfigError
from diloco.config.model import ModelConfig
from diloco.outer.fragments import block_of, count_blocks, fragment_parameter_names, partition_blocks
from diloco.schedule import (
    LastWindow,
    SyncWarmup,
    fragment_offset,
    fragments_to_apply,
    fragments_to_launch,
    last_window,
    next_launch_step,
)
from diloco.train.model import Transformer

# --- partitions ------------------------------------------------------------------------------


def test_strided_partition():
    assert partition_blocks(8, 4, "strided") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert partition_blocks(5, 2, "strided") == [[0, 2, 4], [1, 3]]
    assert partition_blocks(3, 3, "strided") == [[0], [1], [2]]
    assert partition_blocks(4, 1, "strided") == [[0, 1, 2, 3]]


def test_sequential_partition():
    assert partition_blocks(8, 4, "sequential") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert partition_blocks(7, 3, "sequential") == [[0, 1, 2], [3, 4], [5, 6]]
    assert partition_blocks(5, 4, "sequential") == [[0, 1], [2], [3], [4]]
    assert partition_blocks(4, 1, "sequential") == [[0, 1, 2, 3]]


def test_strided_is_the_default():
    assert partition_blocks(6, 3) == partition_blocks(6, 3, "strided")


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("n_blocks", range(1, 13))
def test_partition_covers_every_block_once_and_evenly(pattern, n_blocks):
    for fragments in range(1, n_blocks + 1):
        parts = partition_blocks(n_blocks, fragments, pattern)
        assert len(parts) == fragments
        assert sorted(b for part in parts for b in part) == list(range(n_blocks))
        sizes = [len(part) for part in parts]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_partition_rejects_bad_arguments():
    with pytest.raises(ValueError, match="fragments=5, n_blocks=4"):
        partition_blocks(4, 5, "strided")
    with pytest.raises(ValueError, match="'zigzag'"):
        partition_blocks(4, 2, "zigzag")  # type: ignore[arg-type]


# --- parameter ownership -------------------------------------------------------------------


def test_fragment_rules():
    names = ["tok_embeddings.weight", "layers.5.attention.wq.weight", "norm.weight", "output.weight"]
    assert fragment_parameter_names(names, 8, 4, "strided") == [[names[0]], [names[1]], [], [names[2], names[3]]]
    assert fragment_parameter_names(names, 8, 4, "sequential") == [[names[0]], [], [names[1]], names[2:]]
    # Wrappers that rename parameters do not change the owner; other models' names split the same way.
    assert block_of("_orig_mod.layers.2._checkpoint_wrapped_module.ffn_norm.weight") == 2
    hf = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight"]
    hf += ["model.norm.weight", "lm_head.weight"]
    assert count_blocks(hf) == 2
    assert fragment_parameter_names(hf, 2, 2) == [hf[:2], hf[2:]]
    with pytest.raises(ValueError, match="no fragment for parameter 'rope_cos'"):
        fragment_parameter_names(["layers.0.w", "rope_cos", "layers.1.w"], 2, 2)
    with pytest.raises(ValueError, match="block 8"):
        fragment_parameter_names(["layers.8.ffn_norm.weight"], 8, 4)
    assert fragment_parameter_names(["w", "b"], 0, 1) == [["w", "b"]]  # one fragment: any model


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("fragments", [1, 2, 4])
def test_every_model_parameter_in_exactly_one_fragment(tie, pattern, fragments):
    model = Transformer(ModelConfig(n_layers=4, tie_embeddings=tie))
    names = [name for name, _ in model.named_parameters()]
    assert ("output.weight" in names) is not tie
    parts = fragment_parameter_names(names, 4, fragments, pattern)
    assert len(parts) == fragments
    flat = [n for part in parts for n in part]
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
    for p, part in enumerate(parts):
        assert part == [n for n in names if n in part]  # input order kept
        assert part, f"fragment {p} is empty"
    blocks = partition_blocks(4, fragments, pattern)
    for p, part in enumerate(parts):
        layer_ids = sorted({int(n.split(".")[1]) for n in part if n.startswith("layers.")})
        assert layer_ids == blocks[p]
    assert "tok_embeddings.weight" in parts[0]
    assert "norm.weight" in parts[-1]


# --- schedule --------------------------------------------------------------------------------


def schedule(
    H: int, P: int, tau: int, windows: int, warmup: SyncWarmup | None = None
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """fragment → the steps it is launched / applied at, over ``windows`` windows of H."""
    launches: dict[int, list[int]] = {p: [] for p in range(P)}
    applies: dict[int, list[int]] = {p: [] for p in range(P)}
    for step in range(1, windows * H + 1):
        for p in fragments_to_launch(step, H, P, tau, warmup):
            launches[p].append(step)
        for p in fragments_to_apply(step, H, P, tau, warmup):
            applies[p].append(step)
    return launches, applies


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_streaming_schedule_h12_p3(tau):
    H, P, windows = 12, 3, 4
    launches, applies = schedule(H, P, tau, windows)
    # Fragment p applies at (p+1)·H/P within each window: 4, 8, 12, then 16, 20, 24, ...
    assert applies == {0: [4, 16, 28, 40], 1: [8, 20, 32, 44], 2: [12, 24, 36, 48]}
    for p in range(P):
        # Once per window, and τ steps after its launch.
        for w in range(windows):
            assert sum(w * H < s <= (w + 1) * H for s in applies[p]) == 1
        assert launches[p] == [s - tau for s in applies[p]]
    # Evenly staggered: consecutive applies of any fragment are H/P steps apart.
    every = sorted(s for steps in applies.values() for s in steps)
    assert every == list(range(H // P, windows * H + 1, H // P))
    # At most one all-reduce in flight: the next launch comes after the previous apply.
    in_flight = sorted((launches[p][i], applies[p][i]) for p in range(P) for i in range(windows))
    for (_, applied), (launched, _) in itertools.pairwise(in_flight):
        assert launched > applied


def test_launch_coincides_with_apply_when_tau_is_zero():
    for step in range(1, 49):
        assert fragments_to_launch(step, 12, 3, 0) == fragments_to_apply(step, 12, 3, 0)
    assert fragments_to_apply(12, 12, 12, 0) == [11]
    assert fragments_to_apply(1, 12, 12, 0) == [0]
    # With H = P one fragment is applied after every step.
    assert all(len(fragments_to_apply(s, 12, 12, 0)) == 1 for s in range(1, 25))


def test_plain_diloco_applies_every_h_steps():
    H = 5
    applies = [s for s in range(1, 31) if fragments_to_apply(s, H, 1, 0)]
    launches = [s for s in range(1, 31) if fragments_to_launch(s, H, 1, 0)]
    assert applies == launches == [5, 10, 15, 20, 25, 30]
    assert all(fragments_to_apply(s, H, 1, 0) == [0] for s in applies)
    # H = 1: every step, i.e. data-parallel averaging.
    assert all(fragments_to_apply(s, 1, 1, 0) == [0] for s in range(1, 10))


def test_delay_with_one_fragment_overlaps_the_end_of_the_window():
    launches, applies = schedule(10, 1, 4, 2)
    assert applies == {0: [10, 20]} and launches == {0: [6, 16]}


@pytest.mark.parametrize(
    ("H", "P", "tau", "every", "steps"), [(12, 3, 1, 6, 24), (50, 1, 0, 10, 100), (12, 2, 2, 6, 12)]
)
def test_a_sync_warmup_runs_windows_of_h0_up_to_w_then_of_h(H, P, tau, every, steps):
    warmup = SyncWarmup(every=every, steps=steps)
    launches, applies = schedule(H, P, tau, 4, warmup)
    every_apply = sorted(s for found in applies.values() for s in found)
    warm = list(range(every // P, steps + 1, every // P))
    assert every_apply == warm + list(range(steps + H // P, 4 * H + 1, H // P))
    order = sorted((s, p) for p, found in applies.items() for s in found)
    assert [p for _, p in order] == [i % P for i in range(len(order))], "the fragments take turns across W"
    for p in range(P):
        assert launches[p] == [s - tau for s in applies[p]]
    for step in range(4 * H):
        expected = next(s for s in range(step + 1, 5 * H) if fragments_to_launch(s, H, P, tau, warmup))
        assert next_launch_step(step, H, P, tau, warmup) == expected


@pytest.mark.parametrize(
    ("H", "P", "tau", "warmup", "end", "start"),
    [
        (50, 1, 0, None, 60, 50),
        (50, 1, 4, None, 1234, 1200),
        (50, 1, 4, None, 1201, 1200),  # a one-step window: launched at T, whatever τ
        (12, 3, 2, None, 31, 24),  # T between two fragments' applies (28 falls inside the window)
        (12, 3, 1, SyncWarmup(every=6, steps=24), 17, 12),  # inside the warm-up: its windows of H₀ = 6
        (50, 1, 0, None, 30, 0),  # shorter than one window: the job's only round is at T
    ],
)
def test_a_job_ending_inside_a_window_syncs_every_fragment_once_at_its_end(H, P, tau, warmup, end, start):
    """Up to E the rounds are those of a job ending at E; in (E, T] one round of every fragment,
    applied at T and launched τ_T = min(τ, T − E − 1) steps before, after the apply at E."""
    last = last_window(end, H, warmup)
    assert last == LastWindow(start, end)
    for step in range(1, end + 1):
        applied, launched = (rule(step, H, P, tau, warmup, end) for rule in (fragments_to_apply, fragments_to_launch))
        if step <= start:
            assert applied == fragments_to_apply(step, H, P, tau, warmup)
            assert launched == fragments_to_launch(step, H, P, tau, warmup)
        else:
            assert applied == (list(range(P)) if step == end else [])
            assert launched == (list(range(P)) if step == end - min(tau, end - start - 1) else [])
        expected = next((s for s in range(step + 1, end + 1) if fragments_to_launch(s, H, P, tau, warmup, end)), None)
        assert next_launch_step(step, H, P, tau, warmup, end) == (expected or end + 1)
    assert fragments_to_apply(start or H, H, P, tau, warmup, 2 * H) == fragments_to_apply(start or H, H, P, tau, warmup)
    assert last_window(2 * H, H, warmup) is None and last_window(0, H) is None


def test_without_a_warmup_the_schedule_is_unchanged():
    assert schedule(12, 3, 1, 4, SyncWarmup(every=6, steps=0)) == schedule(12, 3, 1, 4)


def test_fragment_offsets():
    assert [fragment_offset(p, 12, 3) for p in range(3)] == [4, 8, 0]
    assert fragment_offset(0, 7, 1) == 0


def test_schedule_functions_reject_invalid_arguments():
    with pytest.raises(ValueError, match=">= 1"):
        fragments_to_apply(0, 12, 3, 0)
    with pytest.raises(ValueError, match="H=12, P=5"):
        fragments_to_launch(1, 12, 5, 0)
    with pytest.raises(ValueError, match="tau=4"):
        fragments_to_apply(1, 12, 3, 4)


# --- validation ------------------------------------------------------------------------------

GOOD = {"sync_every": 12, "fragments": 3, "delay": 1, "alpha": 0.5, "n_blocks": 12}


def bad(**changes):
    with pytest.raises(ConfigError) as info:
        validate_schedule(**{**GOOD, **changes})
    return str(info.value)


def test_valid_schedules_pass():
    validate_schedule(**GOOD)
    validate_schedule(sync_every=100, fragments=1, delay=0, alpha=0.0, n_blocks=2)
    validate_schedule(sync_every=1, fragments=1, delay=0, alpha=1.0, n_blocks=1)


def test_fragments_must_divide_sync_every_and_the_message_lists_divisors():
    msg = bad(sync_every=30, fragments=4, delay=0, n_blocks=32)
    assert msg.startswith("algo.sync_every=30 is not divisible by algo.fragments=4; pick fragments in ")
    assert "{1, 2, 3, 5, 6, 10, 15, 30}" in msg


def test_divisor_list_respects_the_number_of_blocks():
    msg = bad(sync_every=30, fragments=4, delay=0, n_blocks=8)
    assert "{1, 2, 3, 5, 6}" in msg and "model.n_layers=8" in msg


def test_delay_must_be_below_the_fragment_spacing():
    msg = bad(delay=4)
    assert msg.startswith("algo.delay=4: must be < algo.sync_every / algo.fragments = 4")
    assert "lower algo.delay" in msg
    assert bad(delay=-1).startswith("algo.delay=-1: must be an integer >= 0")


def test_other_keys():
    assert bad(alpha=1.5).startswith("algo.alpha=1.5: must be in [0, 1]")
    assert bad(alpha=-0.1).startswith("algo.alpha=-0.1")
    assert bad(sync_every=0).startswith("algo.sync_every=0: must be an integer >= 1")
    assert bad(fragments=0).startswith("algo.fragments=0: must be an integer >= 1")
    msg = bad(sync_every=24, fragments=24, delay=0, n_blocks=12)
    assert msg.startswith("algo.fragments=24: is larger than the model's 12 transformer blocks (model.n_layers)")
    assert bad(sync_every=True).startswith("algo.sync_every=True")


@pytest.mark.parametrize(
    ("keys", "window"),
    [
        ({}, (10, 500)),
        ({"sync_every": 30}, (10, 510)),  # W rounded up to a whole H window
        ({"name": "streaming", "sync_every": 100, "fragments": 4, "delay": 1}, (20, 500)),  # 10: not P's multiple
        ({"name": "streaming", "sync_every": 100, "fragments": 2, "delay": 4}, (10, 500)),
        ({"name": "streaming", "sync_every": 100, "fragments": 2, "delay": 5}, (20, 500)),  # τ < H₀/P
        ({"sync_every": 12}, None),  # 12 is the only divisor from 10 up: H is short already
        ({"sync_every": 5}, None),
        ({"sync_warmup_steps": 0}, None),
        ({"sync_warmup_every": 1}, (1, 500)),
        ({"name": "ddp", "sync_every": 1}, None),
    ],
)
def test_the_sync_warmup_window_is_the_shortest_the_schedule_allows(keys, window):
    assert AlgoConfig(**keys).sync_warmup_window() == window


@pytest.mark.parametrize(
    ("key", "value"), [("sync_warmup_steps", -1), ("sync_warmup_steps", 2.5), ("sync_warmup_every", 0)]
)
def test_the_sync_warmup_keys_are_counts(key, value):
    with pytest.raises(ConfigError, match=rf"algo.{key}={value}: must be an integer"):
        AlgoConfig(**{key: value}).validate()


def test_ddp_refuses_a_sync_warmup_it_would_not_run():
    with pytest.raises(ConfigError, match="algo.sync_warmup_steps=100 does nothing with algo=ddp"):
        AlgoConfig(name="ddp", sync_every=1, sync_warmup_steps=100).validate()


@pytest.mark.parametrize("groups", [-1, 1.5, True])
def test_alpha_reference_groups_must_be_a_count(groups):
    with pytest.raises(ConfigError, match=rf"algo.alpha_reference_groups={groups}: must be an integer >= 0"):
        AlgoConfig(alpha_reference_groups=groups).validate()


@pytest.mark.parametrize("steps", [-1, 2.5, True])
def test_alpha_warmup_steps_must_be_a_count(steps):
    with pytest.raises(ConfigError, match=rf"algo.alpha_warmup_steps={steps}: must be an integer >= 0"):
        AlgoConfig(alpha_warmup_steps=steps).validate()
