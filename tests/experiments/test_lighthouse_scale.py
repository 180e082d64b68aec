"""experiments/scale/lighthouse_scale.py: its percentiles, latencies, table and target checks on canned
numbers, and a ``--quick`` run of 100 simulated groups against a real lighthouse process.

The smoke run requires no timing target to PASS (a shared CPU is noisy): only that every
round was answered to every group and the numbers came back.
"""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest

from experiments.scale.lighthouse_scale import (
    Ask,
    Formed,
    percentile,
    quorum_latencies,
    report,
    round_summaries,
    table_rows,
    targets,
)
from tests.experiments.in_process import run_main

TIMEOUT_S = 120


def canned_run(groups: int, p99_ms: float, cpu: float, page_s: float) -> dict:
    return {
        "groups": groups,
        "rounds": 12,
        "quorum_p50_ms": 3.25,
        "quorum_p99_ms": p99_ms,
        "quorum_read_p99_ms": 2 * p99_ms,
        "heartbeats_per_s": 1333.3,
        "heartbeat_p99_ms": 4.0,
        "cpu_heartbeats": 0.2,
        "cpu_load": cpu,
        "peak_rss_mb": 250.4,
        "alive_ms": 2.5,
        "status_s": 0.0512,
        "status_kb": 450.0,
        "page_s": page_s,
        "page_kb": 470.0,
        "errors": {"heartbeat TimeoutError": 2} if groups == 1000 else {},
    }


def test_percentile_interpolates_between_ranks():
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_latency_counts_from_the_last_ask_of_each_round_and_skips_the_start():
    asks = [
        Ask("a", asked=1.0, answered=9.0, quorum_id=1, max_step=0, participants=2),  # the start round: skipped
        Ask("b", asked=2.0, answered=9.0, quorum_id=1, max_step=0, participants=2),
        Ask("a", asked=10.0, answered=10.8, quorum_id=1, max_step=1, participants=2, read=10.9),
        Ask("b", asked=10.5, answered=10.75, quorum_id=1, max_step=1, participants=2, read=10.8),
        Ask("a", asked=20.0, answered=20.1, quorum_id=2, max_step=2, participants=1),  # b left: a new id
    ]
    assert sorted(quorum_latencies(asks, after=5.0)) == pytest.approx([0.1, 0.25, 0.3])
    assert sorted(quorum_latencies(asks, after=5.0, read=True)) == pytest.approx([0.1, 0.3, 0.4])  # unread: answered
    formed = {(1, 1): Formed(10.52, 10.56), (2, 2): Formed(20.01, None)}  # a round not sent yet: no sent_ms
    first, second = round_summaries(asks, after=5.0, formed=formed)  # in the order they formed
    assert first == pytest.approx(
        {"answers": 2, "last_ask": 10.5, "asks_over_s": 0.5, "p50_ms": 275.0, "max_ms": 300.0}
        | {"formed_ms": 20.0, "sent_ms": 60.0, "read_max_ms": 400.0}
    )
    assert second == pytest.approx(
        {"answers": 1, "last_ask": 20.0, "asks_over_s": 0.0, "p50_ms": 100.0, "max_ms": 100.0, "formed_ms": 10.0}
    )


def test_table_and_targets_on_canned_numbers():
    runs = [canned_run(100, 5.0, 0.05, 0.02), canned_run(1000, 120.0, 0.45, 1.5)]
    assert table_rows(runs)[1] == [
        "1,000",
        "12",
        "3.2 / 120.0",
        "240.0",
        "1,333",
        "4.0",
        "20%",
        "45%",
        "250",
        "2.5",
        "0.051 (450 KiB)",
        "1.500 (470 KiB)",
        "2",
    ]
    assert targets(runs[1]) == [
        "- quorum p99 within 100 ms at 1,000 groups: 120.0 ms: FAIL",
        "- the lighthouse under 0.5 of a core at 1,000 groups: 0.45: PASS",
        "- the status page under 1 s at 1,000 groups: 1.500 s: FAIL",
    ]
    args = SimpleNamespace(
        window=5.0, spread=0.5, rounds=12, deaths=4, senders=2, lighthouse_cpus={0}, others_cpus={1, 2}
    )
    text = report(runs, args)
    assert "| 100 | 12 | 3.2 / 5.0 | 10.0 |" in text and "quorum p99 within 100 ms at 1,000 groups" in text
    assert "the lighthouse on CPU 0, the senders on 1, 2" in text
    assert text.endswith("errors: heartbeat TimeoutError x2")


@pytest.mark.slow
def test_a_hundred_groups_against_a_real_lighthouse(tmp_path, capsys):
    cpus = os.sched_getaffinity(0)
    pinned = ["--lighthouse-cpus", str(min(cpus))] if len(cpus) > 1 else []
    out, _ = run_main(
        "experiments.scale.lighthouse_scale", ["--quick", *pinned, "--results", str(tmp_path)], TIMEOUT_S, capsys
    )
    assert (tmp_path / "lighthouse_scale.md").read_text().strip() == out.strip()
    [run] = json.loads((tmp_path / "lighthouse_scale.json").read_text())
    assert run["groups"] == 100 and run["rounds"] >= 3, run
    assert run["answers"] >= 100 * run["rounds"] - 10, "nearly every group answered in every round"
    assert run["heartbeats_per_s"] > 50 and 0 < run["cpu_load"] and run["peak_rss_mb"] > 0, run
    assert all(math.isfinite(run[k]) for k in ("quorum_p99_ms", "alive_ms", "status_s", "page_s")), run
    # each round formed (the lighthouse's stamps and the groups' on one clock)
    # and sent its last grant after it formed and before that grant came in (stamped just after the send),
    # which the senders read after it came in (the kernel's receive stamps, on the same clock)
    for r in run["per_round"]:
        assert r["formed_ms"] <= r["sent_ms"] <= r["max_ms"] + 1.0 and r["max_ms"] <= r["read_max_ms"], r
    assert run["quorum_p99_ms"] <= run["quorum_read_p99_ms"], run
    # Kept alive, as the real client keeps them: a few connections a group (one per request it has
    # in flight at once), not one per request (some 30 heartbeats, asks, lane watches and commits each).
    assert run["round_calls"]["connections"] <= 5 * run["groups"], run["round_calls"]
