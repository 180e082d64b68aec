"""A multi-host job across namespaced hosts (experiments/scale/netns_hosts.py) through faults between
hosts: a worker SIGKILLed (torchrun restarts its group, which heals from the peer), a group's link
down and up again (the group is dropped, comes back and heals) and the lighthouse SIGKILLed (its
restart loop starts it again). Each fault waits for the job's progress (new rounds in its commit
logs), not for fixed times. The job must end as if nothing had happened: every part exits 0,
summary.json ok with one digest, and no process nor namespace is left behind. And two of three
groups cut from each other while all reach the lighthouse: the third never sits out, the kept side
commits again soon after the round at the cut failed, the cut-off one is back soon after the link
(slow; need root, ``ip`` and ``tc``: skipped with netns_link.unavailable()'s reason). And
experiments/scale/multihost_chaos.py's and multihost_cuts.py's own arithmetic, on records made up here (fast).

``multihost_chaos.py --quick`` itself is not run here: its two jobs take 75 s on two idle cores
(2.5 min on busy ones), past the minute a test of it may take.
"""

from __future__ import annotations

import random
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest

from diloco.config.cluster import TimeoutsConfig
from diloco.library.build import HEARTBEATS_PER_TIMEOUT
from experiments.communication import netns_link
from experiments.scale.multihost_chaos import (
    KINDS,
    Deck,
    Fault,
    commits,
    cut_pairs,
    digest_mismatches,
    fault_stalls,
    is_back,
    survivor_gap,
)
from experiments.scale.multihost_cuts import cut_off, failed_at, model_step, reformed, sat_out, seconds_to_back
from experiments.scale.netns_hosts import MultihostJob, NetnsHosts

NO_NETNS = netns_link.unavailable()
GROUPS = 2
# Enough steps that the job outlasts the three faults: on two busy cores they took 32 s and 460 steps
# (~15 steps/s per group), then 940 more steps trained on for nothing the test looks at; on two idle
# cores ~20 steps/s, fewer while the lighthouse is down (the groups train on, rounds skipped).
OVERRIDES = ["trainer.max_steps=1000", "algo.sync_every=10"]
LINK_DOWN_S = 8.0  # > cluster.timeouts.heartbeat (3 s): the group is dropped
BACK_S = 60.0  # a restarted or cut-off group back at its peers' round; a lighthouse started again
JOB_S = 240.0
# Three groups, g0 | g1 cut for CUT_S: longer than the round at the cut takes to fail and the kept side's
# next round to form (a cut shorter than cluster.timeouts.collective fails no round: its TCP connections
# resume; on busy cores a round that opened 2 s into a 10-s cut failed at 7 s and the next one asked after
# the link was back, so the kept side never met apart), and steps enough that the job outlasts it and the
# heal (~30 steps/s per group on two idle cores). No link is timed slow
# (cluster.slow_link_factor=0): on two busy cores a probe times the same unshaped link at 36 Mbit/s and at
# 760, and the group it calls slow would sit out for a reason this test is not about.
CUT_GROUPS = 3
CUT_OVERRIDES = [
    "trainer.max_steps=800",
    "algo.sync_every=20",
    "trainer.warmup_share=0",
    "cluster.timeouts.collective=5",
    "cluster.timeouts.connect=5",
    "cluster.slow_link_factor=0",
]
CUT_S = 16.0
# The kept side commits again after the failed round, the cut-off group is back after the link, within
# AGAIN_WITHIN_S or AGAIN_WITHIN_ROUNDS of the job's own round period before the cut, whichever is longer:
# a group asks at its next round boundary, H steps on, and on busy cores those steps take seconds.
AGAIN_WITHIN_S = 5.0
AGAIN_WITHIN_ROUNDS = 3
# The cut-off group sees its link back only at a probe: both sides probe every heartbeat interval, a connect
# taking up to cluster.timeouts.probe on busy cores; and the quorum its first ask after that finds may have
# formed without it (a round more).
BACK_PROBE_S = TimeoutsConfig().heartbeat / HEARTBEATS_PER_TIMEOUT + TimeoutsConfig().probe
BACK_EXTRA_ROUNDS = 1


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout.split())


def _wait(job: MultihostJob, done: Callable[[], bool], what: str, timeout_s: float = BACK_S) -> None:
    """Poll ``done``; fail naming ``what`` if the job ended first (too few steps) or it timed out."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert job.summary() is None, f"the job ended before {what}: raise trainer.max_steps"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.2)


def _ended_ok(job: MultihostJob) -> dict:
    """Wait for the job's end: every part exited 0, summary.json ok with one digest; the summary."""
    for host, end in job.wait(timeout_s=JOB_S).items():
        assert end.returncode == 0 and not end.killed, f"{host}:\n{end.tail}"
    summary = job.summary()
    assert summary is not None and summary["ok"], summary and summary["failure"]
    assert len({r["digest"] for r in summary["per_group"]}) == 1, summary["per_group"]
    return summary


def _committed(job: MultihostJob, group: int) -> int:
    return sum(r["committed"] for r in commits(job.run_dir, job.groups)[group])


def _more_rounds(job: MultihostJob, rounds: int, what: str) -> None:
    """Wait for every group to commit ``rounds`` more rounds."""
    start = [_committed(job, g) for g in range(job.groups)]
    _wait(job, lambda: all(_committed(job, g) >= start[g] + rounds for g in range(job.groups)), what)


def _round_period(records: dict[int, list[dict]], before: float) -> float:
    """The median time between a group's consecutive commits before ``before``, over every group."""
    gaps = [
        b - a
        for rs in records.values()
        for a, b in pairwise(sorted(r["time"] for r in rs if r["committed"] and r["time"] < before))
    ]
    return statistics.median(gaps)


def _back(job: MultihostJob, group: int, since: float, old_pids: set[int] = frozenset(), healed: bool = False) -> bool:
    records = commits(job.run_dir, job.groups)[group]
    if healed:  # it took a peer's state after ``since``
        return any(r.get("healed") and r["time"] > since for r in records)
    return is_back(records, since, set(old_pids))


@pytest.mark.slow
@pytest.mark.skipif(NO_NETNS is not None, reason=f"namespaced hosts: {NO_NETNS}")
def test_a_multihost_job_rides_out_a_worker_kill_a_link_down_and_a_lighthouse_kill(tmp_path: Path):
    with NetnsHosts(["lh", "g0", "g1"]) as hosts:
        namespaces = {hosts.hub, *map(hosts.namespace, hosts.names)}
        with MultihostJob(hosts, tmp_path, groups=GROUPS, overrides=OVERRIDES, max_restarts=2) as job:
            job.start()
            _more_rounds(job, 2, "first rounds")

            # A worker SIGKILLed: torchrun starts the group again and the new worker heals from g1.
            old = {r["pid"] for r in commits(job.run_dir, GROUPS)[0]}
            killed_at = time.time()
            old.add(job.kill_worker(0))
            _wait(job, lambda: _back(job, 0, killed_at, old), "commit by group 0's restarted worker")
            assert _back(job, 0, killed_at, healed=True), "the restarted worker healed from its peer"

            # g1's link down past the heartbeat timeout: g1 is dropped, then comes back and heals.
            _more_rounds(job, 1, "a round of both groups after the restart")
            hosts.link_down("g1")
            time.sleep(LINK_DOWN_S)
            hosts.link_up("g1")
            up_at = time.time()
            _wait(job, lambda: _back(job, 1, up_at, healed=True), "heal of group 1 after its link came back")

            # The lighthouse SIGKILLed: its loop starts it again and the groups commit rounds with it.
            _more_rounds(job, 1, "a round of both groups after the heal")
            lighthouse = job.kill_lighthouse()
            _wait(job, lambda: any(p != lighthouse for p in job.lighthouse_pids()), "lighthouse started again")
            restarted_at = time.time()
            _wait(job, lambda: all(_back(job, g, restarted_at) for g in range(GROUPS)), "rounds after the restart")

            summary = _ended_ok(job)
            assert summary["recoveries"] >= 2, summary
            assert job.leftovers() == []
        logs = {g: (job.log_dir / f"g{g}.log").read_text() for g in range(GROUPS)}
        assert all("healed" in log for log in logs.values()), "each group says it healed"
        assert "lighthouse died; restarting" in (job.log_dir / "lh.log").read_text()
    assert not _namespaces() & namespaces


@pytest.mark.slow
@pytest.mark.skipif(NO_NETNS is not None, reason=f"namespaced hosts: {NO_NETNS}")
def test_two_groups_cut_apart_leave_the_third_in_every_round_and_both_sides_commit_again_soon(tmp_path: Path):
    with (
        NetnsHosts(["lh", "g0", "g1", "g2"]) as hosts,
        MultihostJob(hosts, tmp_path, groups=CUT_GROUPS, overrides=CUT_OVERRIDES) as job,
    ):
        job.start()
        _more_rounds(job, 3, "first rounds")
        cut_at = time.time()
        hosts.partition("g0", "g1")
        time.sleep(CUT_S)
        hosts.heal("g0", "g1")
        link_back = time.time()
        _wait(job, lambda: _back(job, 0, link_back) and _back(job, 1, link_back), "both sides back after the link")
        _ended_ok(job)
        third_log = (job.log_dir / "g2.log").read_text()

    records = commits(job.run_dir, CUT_GROUPS)
    after = {g: [r for r in rs if r["time"] > cut_at] for g, rs in records.items()}
    period = _round_period(records, cut_at)
    within = max(AGAIN_WITHIN_S, AGAIN_WITHIN_ROUNDS * period)
    back_within = within + BACK_PROBE_S + BACK_EXTRA_ROUNDS * period
    failed = failed_at(after, cut_at)
    assert failed is not None, "the round at the cut failed"
    first = reformed(after, cuts=((0, 1),), since=failed)
    assert first is not None, "groups 0 and 1 never met apart"
    third_failed = [r["time"] for r in after[2] if not r["committed"]]
    assert len(third_failed) <= 1 and all(t < first["time"] for t in third_failed), "group 2 failed no other round"
    # While the cut stands no round forms without group 2: a quorum needs a majority of the groups that
    # can meet, and it is in every largest set of them. Once the link is back, a round may form of the pair
    # while group 2 asks later than the join wait (busy cores): that is lateness, not a bench.
    during = [(g, round(r["time"] - cut_at, 1), r["participants"]) for g, rs in after.items() for r in rs]
    without_third = [row for row in during if row[1] <= link_back - cut_at and "group2" not in row[2]]
    assert not without_third, f"group 2 in every quorum while cut; not in (group, s after the cut, quorum): {during}"
    benched = re.findall(r"request of group 'group2' withdrawn: (?:it cannot reach|sits out|its link).*", third_log)
    assert not benched, f"group 2 was turned away: {benched}"
    again = first["time"] - failed
    assert again <= within, (
        f"{first['participants']} committed {again:.1f} s after the failed round (within {within:.1f})"
    )
    # Cut off: those of the pair the last commit before the link's return left out (the side kept may
    # change while the cut stands: a quorum forms of the groups asking, and either side of the pair asks;
    # under load a round may form of group 2 alone, leaving out both).
    left_out = cut_off(after, cuts=((0, 1),), at=link_back)
    assert left_out, "the last commit before the link's return held both of the cut pair"
    for group in left_out:
        back = seconds_to_back(after[group], link_back)
        assert back is not None and back <= back_within, (
            f"group {group}, cut off, back {back} s after its link ({back_within:.1f})"
        )


def _records(times: list[float], pid: int = 1, **extra: object) -> list[dict]:
    return [
        {"committed": True, "time": t, "inner_step": 20 * (i + 1), "pid": pid, **extra} for i, t in enumerate(times)
    ]


def test_survivor_gap_is_the_longest_time_without_a_commit_across_a_fault_beyond_the_usual():
    every_second = _records([float(t) for t in range(10)] + [19.0, 20.0, 21.0, 22.0])
    assert survivor_gap(every_second, start=9.5, end=21.5) == pytest.approx(9.0), "9 -> 19: 10 s, usually 1"
    assert survivor_gap(every_second, start=2.5, end=5.5) == 0.0, "committing as usual: no stall"
    assert survivor_gap(every_second, start=-1.0, end=3.0) is None, "nothing committed before the fault"
    stalled = _records([0.0, 1.0, 2.0, 3.0, 30.0])
    assert survivor_gap(stalled, start=3.5, end=10.0) == pytest.approx(6.0), "still stalled at the end: up to it"
    finished = _records([0.0, 1.0, 2.0, 3.0])
    assert survivor_gap(finished, start=2.5, end=60.0) == 0.0, "a group that finished waits for the end, no stall"


def test_a_faults_stall_counts_only_the_groups_it_did_not_hit():
    records = {g: _records(times, sync_ms=100.0) for g, times in enumerate([[0, 1, 2, 9, 10], [0, 1, 2, 3, 4]])}
    gap, _ = fault_stalls(Fault("link_down", [0], started=2.5, undone=6.0, ended=9.5), records)
    assert gap == pytest.approx(0.0), "group 0 was hit: its stall is not a survivor's"
    gap, _ = fault_stalls(Fault("kill_lighthouse", [], started=2.5, undone=3.0, ended=9.5), records)
    assert gap == pytest.approx(6.0), "the lighthouse: every group a survivor, the worst counts"


def test_the_deck_deals_every_kind_before_repeating_one_and_hits_groups_as_each_kind_needs():
    deck = Deck(KINDS, random.Random(3))
    dealt = [deck.draw(4) for _ in range(2 * len(KINDS))]
    assert sorted(k for k, _ in dealt[: len(KINDS)]) == sorted(KINDS) == sorted(k for k, _ in dealt[len(KINDS) :])
    for kind, hit in dealt:
        sizes = {"partition": 2, "halves": 2, "cut_from_half": 3, "kill_lighthouse": 0}
        assert len(hit) == sizes.get(kind, 1) and set(hit) <= {0, 1, 2, 3} and len(set(hit)) == len(hit)
    assert cut_pairs("halves", [0, 2], 4) == [(0, 1), (0, 3), (2, 1), (2, 3)], "every pair across the halves"
    assert cut_pairs("cut_from_half", [3, 0, 1], 4) == [(3, 0), (3, 1)], "the first hit from the others hit"
    assert cut_pairs("partition", [1, 2], 4) == [(1, 2)]
    again = Deck(KINDS, random.Random(3))
    assert [again.draw(4) for _ in range(len(dealt))] == dealt, "seeded"


def test_is_back_needs_a_commit_or_heal_after_the_fault_by_a_new_process():
    records = _records([1.0, 2.0], pid=7) + [{"committed": False, "healed": True, "time": 5.0, "pid": 8}]
    assert not is_back(records[:2], since=1.5, old_pids={7}), "the killed process's own commit"
    assert is_back(records, since=1.5, old_pids={7})
    assert is_back(records[:2], since=1.5, old_pids=set()), "a link back: the same process commits"


def test_digest_mismatches_count_the_groups_off_the_common_digest():
    assert digest_mismatches({"per_group": [{"digest": "a"}, {"digest": "a"}, {"digest": "b"}]}) == 1
    assert digest_mismatches({"per_group": [{"digest": "a"}, {}]}) == 1
    assert digest_mismatches({"per_group": [{"digest": "a"}] * 4}) == 0


def _round(at: float, groups: list[int], committed: bool = True, **extra: object) -> dict:
    return {"time": at, "committed": committed, "participants": [f"group{g}" for g in groups], **extra}


def _cut_records() -> dict[int, list[dict]]:
    """g0 | g1 cut at 10.5 in three groups committing every second: the round at 11 fails after a
    timeout (at 15), g0 and g2 commit again from 17, g1 heals at 25 once its link is back (at 24)."""
    kept = [_round(t, [0, 1, 2]) for t in range(11)] + [_round(15.0, [0, 1, 2], committed=False)]
    kept += [_round(t, [0, 2]) for t in range(17, 25)] + [_round(t, [0, 1, 2]) for t in range(25, 28)]
    cut_off = [_round(t, [0, 1, 2]) for t in range(11)] + [_round(15.0, [0, 1, 2], committed=False)]
    cut_off += [_round(25.0, [0, 1, 2], healed=True)] + [_round(t, [0, 1, 2]) for t in range(26, 28)]
    return {0: kept, 1: cut_off, 2: kept}


def test_the_job_forms_again_from_the_first_failed_round_to_the_first_commit_without_a_cut_pair():
    records = _cut_records()
    records[0].insert(0, _round(-1.0, [0, 1, 2], committed=False, join=True))
    failed = failed_at(records, since=10.5)
    assert failed == 15.0, "the join round before the cut is no failure"
    assert failed_at(records, since=15.0) is None
    first = reformed(records, cuts=((0, 1),), since=failed)
    assert first["time"] == 17.0 and first["participants"] == ["group0", "group2"]
    assert reformed(records, cuts=((0, 2),), since=failed) is None, "every quorum since holds the cut pair"
    assert cut_off(records, cuts=((0, 1),), at=24.0) == [1], "the one the last commit before the link left out"
    assert cut_off(records, cuts=((0, 1),), at=-1.0) == [0, 1], "nothing committed yet: both"
    assert seconds_to_back(records[1], since=24.0) == pytest.approx(1.0), "its heal counts as back"
    assert seconds_to_back(records[1], since=27.0) is None


def test_a_group_sat_out_from_its_last_commit_to_its_heal_while_others_committed_without_it():
    records = _cut_records()
    assert sat_out(records, 1) == pytest.approx(15.0), "10 -> 25, rounds 17..24 without it"
    assert sat_out(records, 0) == 0.0 == sat_out(records, 2), "a failed round everyone shared is no sitting out"
    late = {0: [_round(t, [0]) for t in range(5)], 1: [_round(3.0, [0, 1], healed=True), _round(4.0, [0, 1])]}
    assert sat_out(late, 1) == pytest.approx(3.0), "from the job's first record to its first heal"


def test_the_final_step_is_summarys_lost_work_else_the_final_rounds_commits():
    lost = {"global_step": 1480, "max_steps": 1500, "group_steps_lost": 360}
    assert model_step({"lost_work": lost}, {}, 1500) == {"step": 1480, "max_steps": 1500, "lost": 360}
    records = {0: [_round(1.0, [0, 1], round=74, inner_step=1500)], 1: [_round(1.0, [0, 1], round=73, inner_step=1480)]}
    assert model_step({"final_round": 73}, records, 1500) == {"step": 1480, "max_steps": 1500, "lost": None}
