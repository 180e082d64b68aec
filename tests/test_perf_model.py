"""The performance model (diloco/perf_model.py): its closed forms, and the scale simulation it feeds."""

from __future__ import annotations

import math

import pytest

from diloco.perf_model import Link, SyncPlan, allreduce_seconds, bandwidth_for, utilization, window_seconds
from experiments import simulate_scale

GBIT = 1e9


def test_a_ring_all_reduce_sends_2_m_minus_1_over_m_of_the_payload_plus_a_latency_per_hop():
    link = Link(bandwidth_bps=8 * GBIT, latency_s=0.01)
    assert allreduce_seconds(1e9, 2, link) == pytest.approx(1.0 + 2 * 0.01)  # 1 GB over 8 Gbit/s, 2 hops
    assert allreduce_seconds(1e9, 4, link) == pytest.approx(1.5 + 6 * 0.01)
    assert allreduce_seconds(1e9, 1, link) == 0.0, "one group sends nothing"


def test_an_unhidden_sync_stalls_every_window_and_overlap_hides_it():
    link = Link(bandwidth_bps=8 * GBIT)
    diloco = SyncPlan(sync_every=10, bits_per_param=8)  # 1e9 params: 1 GB, 1 s over 2 groups
    assert window_seconds(diloco, 1e9, 0.5, 2, link) == pytest.approx(10 * 0.5 + 1.0)
    assert utilization(diloco, 1e9, 0.5, 2, link) == pytest.approx(5 / 6)
    streaming = SyncPlan(sync_every=10, fragments=2, overlap_steps=1, bits_per_param=8)
    assert utilization(streaming, 1e9, 0.5, 2, link) == 1.0, "each half-size fragment fits in its τ=1 step"
    partly = SyncPlan(sync_every=10, fragments=2, overlap_steps=1, bits_per_param=8)
    assert window_seconds(partly, 1e9, 0.2, 2, link) == pytest.approx(10 * 0.2 + 2 * (0.5 - 0.2))


@pytest.mark.parametrize(
    "plan",
    [
        SyncPlan(),
        SyncPlan(sync_every=1, bits_per_param=16, overlap_backward=0.5),
        SyncPlan(sync_every=50),
        SyncPlan(sync_every=100, fragments=4, overlap_steps=3, bits_per_param=4),
    ],
)
@pytest.mark.parametrize("target", [0.5, 0.9, 0.95, 0.99])
def test_the_bandwidth_for_a_utilization_gives_exactly_that_utilization(plan, target):
    needed = bandwidth_for(target, plan, 1e8, 0.3, 3, latency_s=0.001)
    if math.isinf(needed):  # the latency of the 4 hops alone outlasts what the target leaves
        assert utilization(plan, 1e8, 0.3, 3, Link(1e30, latency_s=0.001)) < target
        return
    assert utilization(plan, 1e8, 0.3, 3, Link(needed, latency_s=0.001)) == pytest.approx(target)
    assert utilization(plan, 1e8, 0.3, 3, Link(needed * 1.01, latency_s=0.001)) > target


def test_bandwidth_edge_cases_and_invalid_plans():
    assert bandwidth_for(0.95, SyncPlan(), 1e9, 1.0, 1) == 0.0, "one group needs no link"
    assert math.isinf(bandwidth_for(0.95, SyncPlan(), 1e9, 1.0, 2, latency_s=1.0)), "latency alone is too slow"
    same = bandwidth_for(0.95, SyncPlan(sync_every=100), 1e9, 1.0, 2)
    assert bandwidth_for(0.95, SyncPlan(sync_every=100, fragments=4), 1e9, 1.0, 2) == pytest.approx(same), (
        "fragments without overlap only spread the same bytes over the same compute"
    )
    for bad in (dict(sync_every=10, fragments=3), dict(sync_every=10, fragments=2, overlap_steps=5)):
        with pytest.raises(ValueError):
            SyncPlan(**bad)
    with pytest.raises(ValueError):
        bandwidth_for(0.0, SyncPlan(), 1e9, 1.0, 2)


def test_the_scale_simulation_is_calibrated_on_data_parallel_and_predicts_the_rest():
    rows = simulate_scale.rows(0.95, 2)
    assert [r[0] for r in rows] == ["1B", "10B", "100B"]
    assert rows[0][2] == "222.3 (222.3)" and rows[2][2] == "390.7 (390.7)"
    for row in rows:
        needed = [float(cell.split()[0]) for cell in row[2:]]
        assert needed == sorted(needed, reverse=True), f"each technique needs less than the one before: {row}"
    model = [float(v) for v in simulate_scale.ratio_rows(0.95, 2)[0][1:]]
    paper_1b = [v / 222.3 for v in simulate_scale.PAPER[1e9]]
    assert all(abs(m - p) < 0.02 for m, p in zip(model, paper_1b)), (model, paper_1b)
