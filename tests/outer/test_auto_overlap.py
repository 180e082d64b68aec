"""algo.auto and the lane bandwidth limit: the token bucket, the plan on both sides of each
threshold, and groups (threads, real lighthouse and Gloo lanes) re-planning alike over a slow link."""

from __future__ import annotations

import time

import pytest
import torch

from diloco.config.algo import AlgoConfig
from diloco.config.base import ConfigError
from diloco.outer.auto_overlap import AutoOverlap
from diloco.outer.bandwidth import TokenBucket, bucket_for
from diloco.outer.codecs import Dense, format_codec, launch_reduce
from diloco.outer.overlap_plan import HYSTERESIS, STALL_SLACK, choose_overlap
from diloco.outer.quantize import FORMATS
from diloco.train.inner_opt import build_inner_optimizer
from diloco.train.logger import read_jsonl
from diloco.train.model import Transformer
from tests.conftest import compose_job
from tests.outer.test_outer import BASE, lighthouse_for, mock_inner_step, outer_for, run_threads


# -- the token bucket ---------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_token_bucket_lets_a_burst_through_and_paces_the_rest_at_its_rate():
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst_s=0.05, clock=clock)  # 1,000 bytes/s, 50 bytes of burst
    assert bucket.reserve(50) == 0.0, "the burst goes at once"
    assert bucket.reserve(100) == pytest.approx(0.1), "then 100 bytes take 0.1 s"
    assert bucket.reserve(100) == pytest.approx(0.2), "and queue behind the ones before"
    clock.now = 10.0
    assert bucket.reserve(50) == 10.0, "an idle link saves up no more than the burst"
    assert bucket.reserve(1) == pytest.approx(10.001)


def test_lane_bandwidth_in_megabits_and_zero_means_unlimited():
    assert bucket_for(0.0) is None
    assert bucket_for(8.0).rate_bytes_s == 1e6
    with pytest.raises(ValueError):
        TokenBucket(0.0)


class MirrorLane:
    """A stand-in lane of ``size`` members that all send what this one sends (pure logic only)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def allreduce(self, tensors):
        tensors[0].mul_(self.size)
        return None

    def allgather(self, outputs, inputs):
        for out in outputs[0]:
            out.copy_(inputs[0])
        return None


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_planned_bytes_are_the_bytes_a_reduce_sends_and_extras_are_summed(fmt):
    delta, extras = torch.randn(1000), torch.tensor([1.0, 0.25, 3e-7])
    pending = launch_reduce(MirrorLane(3), delta, 2.0, format_codec(fmt), 3, extras=extras)
    assert pending.bytes_sent == format_codec(fmt).bytes_sent(1000, 3, n_extras=3)
    average = pending.result(lambda work: None)
    torch.testing.assert_close(pending.extras, 3 * extras)
    assert average.shape == delta.shape


def test_a_bandwidth_limited_reduce_is_held_until_the_link_carried_its_bytes():
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst_s=0.0, clock=clock)
    pending = launch_reduce(MirrorLane(2), torch.zeros(100), 1.0, Dense(), 2, bucket=bucket)
    assert pending.ready_at == pytest.approx(pending.bytes_sent / 1000.0)


# -- the plan -----------------------------------------------------------------------------------
NUMEL, GROUPS, WINDOW, STEP = 100_000, 2, 10, 0.1
SLACK = STALL_SLACK * WINDOW * STEP


def _seconds_per_byte(fmt: str, transfer_s: float) -> float:
    """The link speed at which a fragment's reduce in ``fmt`` takes ``transfer_s``."""
    return transfer_s / format_codec(fmt).bytes_sent(NUMEL, GROUPS)


def _plan(seconds_per_byte: float, current=None) -> tuple[int, str]:
    plan = choose_overlap(
        fragment_numel=NUMEL,
        groups=GROUPS,
        window_steps=WINDOW,
        step_s=STEP,
        seconds_per_byte=seconds_per_byte,
        current=current,
    )
    return plan.delay, plan.quantize


def test_a_fast_link_keeps_no_overlap_and_full_precision():
    assert _plan(0.0) == (0, "none")
    assert _plan(_seconds_per_byte("none", SLACK * 0.999)) == (0, "none"), "a stall within the slack counts as hidden"
    assert _plan(_seconds_per_byte("none", SLACK * 1.01)) == (0, "bf16"), "just over: half the bits"


def test_the_smallest_overlap_that_hides_the_transfer_then_the_most_bits_that_fit():
    # fp32 takes 2.5 steps: nothing fits without overlap, unless 4 bits do (1/8 of 2.5 steps is
    # over the slack); with one step of overlap bf16 (1.25 steps) does not fit, fp8 does.
    spb = _seconds_per_byte("none", 2.5 * STEP)
    assert _plan(spb) == (1, "fp8")
    assert _plan(_seconds_per_byte("none", 1.9 * STEP)) == (1, "bf16")
    assert _plan(_seconds_per_byte("fp4", (3.0 * STEP + SLACK) * 0.999)) == (3, "fp4"), "just within the bound"
    assert _plan(_seconds_per_byte("fp4", 3.0 * STEP + SLACK * 1.1)) == (4, "fp4")


def test_a_link_too_slow_for_anything_gets_the_least_stall():
    assert _plan(_seconds_per_byte("fp4", 20 * STEP)) == (WINDOW - 1, "fp4")


def test_a_fitting_plan_is_kept_until_a_better_one_fits_with_a_margin():
    tight = _seconds_per_byte("fp4", 2.0 * STEP)  # fp4 fits at τ = 2 (within the slack)
    assert _plan(tight) == (2, "fp4")
    assert _plan(tight, current=(4, "fp4")) == (4, "fp4"), "τ=2 fits, but by less than the margin"
    roomy = _seconds_per_byte("fp4", (2.0 * STEP + SLACK) * (1 - HYSTERESIS) * 0.99)
    assert _plan(roomy, current=(4, "fp4")) == (2, "fp4"), "fits with the margin: take the better plan"
    assert _plan(_seconds_per_byte("fp4", 5.0 * STEP), current=(4, "fp4")) == (5, "fp4"), "current stalls: move"
    assert _plan(tight, current=(1, "int8")) == (2, "fp4"), "a format the plan never picks is not kept"


def test_plans_need_sane_inputs():
    with pytest.raises(ValueError, match="need positive sizes"):
        choose_overlap(fragment_numel=0, groups=2, window_steps=4, step_s=0.1, seconds_per_byte=1e-6)


def test_the_plan_from_summed_measurements_and_its_bounds():
    algo = AlgoConfig(name="streaming", sync_every=40, fragments=2, delay=1, quantize="fp4", auto=True)
    auto = AutoOverlap(algo, NUMEL)
    assert auto.measurements().tolist() == [0.0, 0.0, 0.0], "nothing measured yet"
    assert auto.decide(torch.zeros(3), 2) is None
    auto.step_begins()
    auto.step_ends()
    auto.transferred(0.5, 1000)
    sent = auto.measurements()
    assert sent[0] == 1.0 and sent[2] == pytest.approx(5e-4)
    assert auto.measurements()[0] == 0.0, "each window's steps are measured anew"
    two_groups = torch.tensor([2.0, 2 * 0.1, 2 * 1e-9])  # a fast link, 0.1 s steps
    plan = auto.decide(two_groups, 2)
    assert (plan.delay, plan.quantize) == (0, "none")
    auto.adopt(auto.encode(plan))
    auto.follow()
    assert (auto.delay, auto.quantize, auto.codec) == (0, "none", Dense())
    auto.adopt([20, 0])  # τ must stay below H/P = 20
    with pytest.raises(ValueError, match="out of range"):
        auto.follow()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.auto=true"], "algo.auto=True"),
        (["algo=ddp", "algo.auto=true"], "algo.auto=True"),
        (["cluster.lane_bandwidth_mbps=-1"], "cluster.lane_bandwidth_mbps=-1"),
    ],
)
def test_auto_and_bandwidth_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_job(BASE + overrides)


@pytest.mark.slow  # a lighthouse and its groups' rounds (~1-2 s)
# -- groups re-planning alike --------------------------------------------------------------------
def test_groups_over_a_slow_link_move_to_the_same_larger_overlap_and_agree(tmp_path):
    """2 Mbit/s: a fragment's fp4 reduce (~33 KB) takes ~0.13 s, more than the H/P = 4 inner steps
    of ~20 ms: both groups move from the preset's τ=1 to the largest, τ=3, from the round after
    the first measured one, and keep equal states."""
    job = compose_job(
        BASE
        + [
            "cluster.groups=2",
            "algo=streaming",
            "algo.sync_every=8",
            "algo.fragments=2",
            "trainer.max_steps=16",
            "algo.auto=true",
            "cluster.lane_bandwidth_mbps=2",
        ]
    )
    torch.manual_seed(0)
    models = [Transformer(job.model) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    with lighthouse_for(job) as job:
        outers = [
            outer_for(job, g, m, build_inner_optimizer(list(m.parameters()), job.inner_opt, 16)[0], tmp_path)
            for g, m in enumerate(models)
        ]

        def group(g: int) -> None:
            outers[g].join()
            for step in range(1, 17):
                mock_inner_step(models[g], step, 1.0 + g)
                time.sleep(0.02)
                outers[g].after_inner_step(step, tokens=1)
            outers[g].close()

        run_threads(lambda: group(0), lambda: group(1))
    assert [(o.plan.delay, o.plan.quantize) for o in outers] == [(3, "fp4"), (3, "fp4")]
    assert outers[0].group_digest() == outers[1].group_digest()
    records = [r for r in read_jsonl(tmp_path / "commits0.jsonl") if r["committed"]]
    assert records[0]["delay"] == 1 and records[-1]["delay"] == 3, records
    assert all(r["quantize"] == "fp4" for r in records)
    assert records[-1]["link_s_per_byte"] > 0, "the link the plan was made for, in the record"
