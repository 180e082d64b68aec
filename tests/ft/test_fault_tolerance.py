"""Fault tolerance with real processes on loopback: kills, hangs, late joins, injected failures.

Every test drives a real lighthouse and real worker processes through ``LocalCluster`` and
checks docs/design.md's invariants from the groups' commit logs: after every committed round all
groups that committed it hold the same digest of θ_g and outer-optimizer state.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from diloco.launch.local_cluster import LocalCluster, log_tail, wait_until
from diloco.launch.summary import state_losses
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from diloco.worker.builders import preflight
from tests.conftest import NO_PROXY, compose_job

pytestmark = pytest.mark.slow

FT = [
    "logger=none",
    "trainer.seq_len=64",
    "trainer.batch_size=4",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
    "trainer.log_every=10",
    "algo.sync_every=10",
    "cluster.device=cpu",
    "cluster.workers_per_group=1",
    "cluster.groups=3",
    "cluster.timeouts.heartbeat=2",
    "cluster.timeouts.join=1",
    "cluster.timeouts.quorum=30",
    "cluster.timeouts.collective=8",
    "cluster.timeouts.connect=20",
    "cluster.timeouts.start=3",  # a test that starts a group late does not wait a minute for its first quorum
]


def commits(paths: RunPaths, group: int) -> list[dict]:
    return read_jsonl(paths.commits(group))


def committed_rounds(paths: RunPaths, group: int) -> list[dict]:
    return [r for r in commits(paths, group) if r["committed"]]


def assert_digests_agree(paths: RunPaths, groups: int) -> int:
    """docs/design.md, invariant 1: every round committed by several groups has one digest.
    Returns how many rounds were shared."""
    by_round: dict[int, set[str]] = {}
    for g in range(groups):
        for record in committed_rounds(paths, g):
            by_round.setdefault(record["round"], set()).add(record["digest"])
    disagreeing = {r: d for r, d in by_round.items() if len(d) > 1}
    assert not disagreeing, f"groups disagree on θ_g after rounds {sorted(disagreeing)}"
    return len(by_round)


class Job:
    """A LocalCluster (``cluster.wait_for`` polls it) with helpers reading its commit logs; always stopped."""

    def __init__(self, tmp_path: Path, *overrides: str) -> None:
        self.job = compose_job(FT + list(overrides))
        self.paths = RunPaths(tmp_path / "run")
        self.paths.root.mkdir(parents=True)
        _, self.signature = preflight(self.job, self.paths)
        self.cluster = LocalCluster(self.job, self.paths, self.signature)

    def start(self, groups: range | list[int]) -> None:
        if self.cluster.lighthouse is None:
            self.cluster.start_lighthouse()
        for g in groups:
            self.cluster.start_group(g)

    def rounds_of(self, group: int) -> int:
        done = committed_rounds(self.paths, group)
        return done[-1]["round"] if done else 0

    def committed_with(self, group: int, participants: list[str], after_round: int = 0) -> bool:
        return any(
            r["participants"] == participants and r["round"] > after_round for r in committed_rounds(self.paths, group)
        )

    def leader_pid(self, group: int) -> int:
        return next(w for w in self.cluster.groups[group] if w.rank == 0).process.pid

    def recoveries_of(self, group: int) -> int:
        return max((r["recoveries"] for r in commits(self.paths, group)), default=0)


@pytest.fixture
def job_factory(tmp_path):
    jobs: list[Job] = []

    def make(*overrides: str) -> Job:
        jobs.append(Job(tmp_path / str(len(jobs)), *overrides))
        return jobs[-1]

    yield make
    for job in jobs:
        job.cluster.stop()


ALL3 = ["group0", "group1", "group2"]
SYNC_WARMUP = ["algo.sync_every=20", "algo.sync_warmup_every=10", "algo.sync_warmup_steps=100000"]


ALGOS = {
    "diloco": [],
    "streaming": ["algo=streaming", "algo.fragments=2", "algo.delay=1", "algo.alpha=0.5", "algo.quantize=fp4"],
    "ddp": ["algo=ddp", "algo.sync_every=1"],
}
# Tensor (and sequence) parallelism inside each group: either of the two ranks' shards heals from the same
# rank of a peer.
STREAMING_TP2 = [*ALGOS["streaming"], "cluster.workers_per_group=2", "parallel.tp=2", "parallel.sequence_parallel=true"]
# Two pipeline stages: only the last stage's worker is killed; the first stage's fails out of the
# pipeline (it does not wait forever), and the restarted group heals each stage from the same rank of a peer.
STREAMING_PP2 = [*ALGOS["streaming"], "cluster.workers_per_group=2", "parallel.pp=2", "trainer.batch_size=2"]
# inner_opt=muon with FSDP2: each worker's shard of the momentum buffers and Adam moments heals from a peer.
MUON_FSDP2 = ["inner_opt=muon", "cluster.workers_per_group=2"]
LAYOUTS = {"streaming, tp 2": STREAMING_TP2, "streaming, pp 2": STREAMING_PP2, "diloco, muon, fsdp 2": MUON_FSDP2}


def status_groups(job: Job) -> list[dict]:
    """The groups as the lighthouse's /status shows them."""
    with NO_PROXY.open(job.cluster.lighthouse_url + "/status", timeout=5.0) as answer:
        return json.loads(answer.read())["groups"]


def stale_figures(job: Job) -> tuple[list[str], int]:
    """The groups whose inner step on /status is behind the round the lighthouse holds them at,
    and how many groups past their first round were looked at. A round is committed after its
    inner steps and every sign of life (heartbeat, quorum ask, commit) carries the group's
    progress, so the figure is at least the inner step of the group's round before, less one
    log line's steps (progress is noted at log lines)."""
    stale, looked_at = [], 0
    for group in status_groups(job):
        shown = group.get("inner_step", 0)
        steps = {
            r["round"]: r["inner_step"] for r in committed_rounds(job.paths, int(group["id"].removeprefix("group")))
        }
        if (before := steps.get(group["step"] - 1)) is None:  # no round yet, or healed to this one
            continue
        looked_at += 1
        if shown < before - job.job.trainer.log_every:
            stale.append(f"{group['id']} at round {group['step']} shows inner step {shown}, round before was {before}")
    return stale, looked_at


@dataclasses.dataclass
class StatusCheck:
    """/status looked at each time a wait polls: what ``stale_figures`` found, and how many groups it looked at."""

    job: Job
    stale: list[str] = dataclasses.field(default_factory=list)
    looked_at: int = 0

    def alongside(self, condition: Callable[[], bool]) -> Callable[[], bool]:
        def check() -> bool:
            found, seen = stale_figures(self.job)
            self.stale += found
            self.looked_at += seen
            return condition()

        return check


@pytest.mark.parametrize("algo", ["diloco", "streaming"])
def test_three_groups_hold_identical_state_after_every_commit(job_factory, algo):
    """Two workers per group: with streaming the rounds run on a background thread beside FSDP."""
    job = job_factory("cluster.workers_per_group=2", "trainer.max_steps=60", *ALGOS[algo])
    job.start(range(3))
    job.cluster.wait_for(job.cluster.finished, 180, "all groups to finish")
    shared = assert_digests_agree(job.paths, 3)
    assert shared >= 6
    results = [json.loads(job.paths.result(g).read_text()) for g in range(3)]
    assert len({r["digest"] for r in results}) == 1, "final global state differs between groups"
    assert len({r["rounds"] for r in results}) == 1


@pytest.mark.parametrize("algo", [*sorted(ALGOS), *LAYOUTS])
def test_killed_group_is_left_out_then_heals_when_restarted(job_factory, algo):
    job = job_factory("trainer.max_steps=100000", *ALGOS.get(algo, LAYOUTS.get(algo)))
    job.start(range(3))
    job.cluster.wait_for(
        lambda: all(job.committed_with(g, ALL3) for g in range(3)), 120, "a round committed by all three"
    )
    timeouts = job.job.cluster.timeouts
    if algo == "streaming, pp 2":
        first, last = sorted(job.cluster.groups[2], key=lambda w: w.rank)
        last.process.send_signal(signal.SIGKILL)
        wait_until(lambda: first.process.poll() is not None, timeouts.collective + 30, "stage 0 to fail out")
    job.cluster.signal_group(2, signal.SIGKILL)
    killed_at_round = job.rounds_of(0)
    stall = job.cluster.wait_for(
        lambda: job.committed_with(0, ["group0", "group1"], killed_at_round), 60, "survivors to commit without group2"
    )
    assert stall < timeouts.heartbeat + timeouts.join + timeouts.collective + 5
    job.cluster.start_group(2)
    before = job.rounds_of(0)
    job.cluster.wait_for(
        lambda: job.committed_with(2, ALL3, before), 120, "the restarted group2 to heal and commit with all"
    )
    assert job.recoveries_of(2) >= 1
    assert assert_digests_agree(job.paths, 3) >= 3  # all three, the two survivors, all three again


def test_a_warm_spare_takes_over_a_killed_group_and_heals(job_factory):
    """A spare of two FSDP workers builds itself (and starts its leader's wandb run) while the
    groups train, stays out of every quorum, and once handed the killed group's id heals from
    the survivor and commits with it, logging to the wandb run it started (renamed to the group's)."""
    job = job_factory("cluster.groups=2", "cluster.workers_per_group=2", "trainer.max_steps=100000", "logger=wandb")
    job.start(range(2))
    spare = job.cluster.start_spare()
    both = ["group0", "group1"]
    job.cluster.wait_for(lambda: all(job.committed_with(g, both) for g in range(2)), 120, "a round of both groups")
    runs = job.paths.root / "wandb"
    job.cluster.wait_for(lambda: len(list(runs.glob("offline-run-*"))) == 3, 60, "the spare's own wandb run")
    job.cluster.signal_group(1, signal.SIGKILL)
    job.cluster.wait_for(lambda: job.cluster.take_spare(1) is not None, 60, "the spare to be built and take group1")
    spare_took = time.time()
    spare_leader = spare.workers[0].process.pid
    assert job.leader_pid(1) == spare_leader and not job.cluster.spares
    taken_at = job.rounds_of(0)
    job.cluster.wait_for(lambda: job.committed_with(1, both, taken_at), 120, "the spare to heal and commit as group1")
    records = commits(job.paths, 1)
    first = next(i for i, r in enumerate(records) if r["pid"] == spare_leader)
    assert all(r["pid"] == spare_leader for r in records[first:]), "only the spare writes group1's log now"
    assert max(r["recoveries"] for r in records[first:]) == 1, "it took the live state from group0, once"
    assert assert_digests_agree(job.paths, 2) >= 2
    quorum_members = {p for g in range(2) for r in commits(job.paths, g) for p in r["participants"]}
    assert quorum_members == set(both), "a spare is never a member of a quorum under a name of its own"

    def logged_as_group1() -> bool:
        return any("train/loss" in r and r["time"] > spare_took for r in read_jsonl(job.paths.metrics(1)))

    job.cluster.wait_for(logged_as_group1, 60, "the spare to log as group1")
    assert len(list(runs.glob("offline-run-*"))) == 3, "the spare logs to the wandb run it started, renamed"
    for rank in range(2):
        assert "takes over group 1" in job.paths.worker_log(1, rank).read_text()
        waiting = job.paths.spare_log(spare.index, rank).read_text()
        assert "group" not in waiting and "healed" not in waiting, f"a waiting spare does nothing: {waiting}"


def test_late_group_heals_and_joins(job_factory):
    """Inside a sync warm-up (H = 20, windows of 10 through the job): the late group joins its
    schedule. Those rounds come faster than heartbeats: /status must still show each group's
    progress as of its last word to the lighthouse (``stale_figures``)."""
    job = job_factory("trainer.max_steps=100000", *SYNC_WARMUP)
    job.start([0, 1])
    status = StatusCheck(job)
    job.cluster.wait_for(status.alongside(lambda: job.rounds_of(0) >= 3), 120, "two groups to commit three rounds")
    job.start([2])
    joined = status.alongside(lambda: job.committed_with(2, ALL3))
    job.cluster.wait_for(joined, 120, "the late group2 to join a committed round")
    assert not status.stale, f"/status fell behind the groups (short rounds): {status.stale[:5]}"
    assert status.looked_at >= 4, "too few groups past a round on /status: the check proved nothing"
    assert job.recoveries_of(2) == 1
    first = committed_rounds(job.paths, 2)[0]
    assert first["round"] > 3, "the late group must continue the job's rounds, not start its own"
    assert_digests_agree(job.paths, 3)


def test_followers_outwait_a_leader_kept_waiting_for_its_first_quorum(job_factory):
    """Group 1 starts late by more than the collective timeout. Group 0's leader long-polls for
    the job's first quorum (it waits for every group) while its second rank waits for the
    answer on the group's control channel: that rank must outwait its leader, not die at the
    collective timeout and take a healthy group down with it."""
    job = job_factory(
        "cluster.groups=2",
        "cluster.workers_per_group=2",
        "trainer.max_steps=100000",
        "cluster.timeouts.collective=3",
        "cluster.timeouts.start=90",
    )
    job.start([0])

    def asked_for_a_quorum() -> bool:
        return any(g["id"] == "group0" and g["waiting_for_quorum"] for g in status_groups(job))

    job.cluster.wait_for(asked_for_a_quorum, 60, "group0's leader to ask for its first quorum")
    time.sleep(2 * job.job.cluster.timeouts.collective + 1)
    assert job.cluster.failed_worker() is None, "group0 died while its leader waited for a quorum"
    job.start([1])
    both = ["group0", "group1"]
    job.cluster.wait_for(lambda: all(job.committed_with(g, both) for g in range(2)), 120, "a round of both groups")
    assert assert_digests_agree(job.paths, 2) >= 1


def test_injected_allreduce_failure_is_not_committed_and_heals(job_factory):
    job = job_factory("trainer.max_steps=100000", "faults.accept_requests=true")
    job.start(range(3))
    job.cluster.wait_for(
        lambda: all(job.committed_with(g, ALL3) for g in range(3)), 120, "a round committed by all three"
    )
    job.cluster.request_fault(1, "fail_round")
    job.cluster.wait_for(lambda: any(not r["committed"] for r in commits(job.paths, 1)), 60, "group1's round to fail")
    failed_round = next(r for r in commits(job.paths, 1) if not r["committed"])
    assert job.committed_with(0, ALL3, failed_round["round"] - 1), "the others commit the round group1 failed"
    job.cluster.wait_for(lambda: job.recoveries_of(1) >= 1, 60, "group1 to heal from a peer")
    after = job.rounds_of(0)
    job.cluster.wait_for(lambda: job.committed_with(1, ALL3, after), 60, "group1 to commit again with everyone")
    assert_digests_agree(job.paths, 3)


def test_a_group_hung_mid_allreduce_costs_the_others_a_heartbeat_timeout_and_heals_after_sigcont(job_factory):
    """Group2 SIGSTOPs itself with its all-reduce in flight. The survivors do
    not wait out cluster.timeouts.collective (30 s here): the lighthouse drops group2 after
    cluster.timeouts.heartbeat (2 s), their lane watch gives the round up, nobody commits it,
    and they go on without group2; resumed, group2 may not commit the round either, heals and
    commits with everyone again."""
    job = job_factory("trainer.max_steps=100000", "faults.accept_requests=true", "cluster.timeouts.collective=30")
    job.start(range(3))
    job.cluster.wait_for(
        lambda: all(job.committed_with(g, ALL3) for g in range(3)), 120, "a round committed by all three"
    )
    seen = len(commits(job.paths, 0))
    job.cluster.request_fault(2, "stop_in_round")

    def failed_rounds() -> list[dict]:
        return [r for r in commits(job.paths, 0)[seen:] if not r["committed"] and not r["join"]]

    job.cluster.wait_for(failed_rounds, 60, "group0's round to fail")
    failed = failed_rounds()[0]
    given_up = (job.paths.logs / "group0_rank0.log").read_text()
    assert "group group2 left round" in given_up and "no heartbeat" in given_up, "not given up by the lane watch"
    assert not any(
        r["round"] == failed["round"] + 1 and r["participants"] == ALL3
        for g in range(3)
        for r in committed_rounds(job.paths, g)
    ), "a group committed the round the others gave up"
    print(f"survivors' stall at a peer hung mid all-reduce: {failed['sync_ms'] / 1000:.1f} s (heartbeat timeout 2 s)")
    stopped_at = job.rounds_of(0)
    job.cluster.wait_for(
        lambda: job.committed_with(0, ["group0", "group1"], stopped_at), 60, "survivors to go on without group2"
    )
    job.cluster.signal_group(2, signal.SIGCONT)
    after = job.rounds_of(0)
    job.cluster.wait_for(
        lambda: job.committed_with(2, ALL3, after), 90, "group2 to heal and commit with all after SIGCONT"
    )
    assert job.recoveries_of(2) >= 1
    assert_digests_agree(job.paths, 3)


def test_training_goes_on_through_a_lighthouse_restart(job_factory):
    job = job_factory("cluster.groups=2", "trainer.max_steps=100000")
    job.start(range(2))
    job.cluster.wait_for(lambda: job.rounds_of(0) >= 3, 120, "three committed rounds")
    last_quorum = committed_rounds(job.paths, 0)[-1]["quorum_id"]
    job.cluster.kill_lighthouse()
    time.sleep(3)
    assert job.cluster.failed_worker() is None, "groups must keep running without a lighthouse"
    job.cluster.start_lighthouse()
    before = job.rounds_of(0)
    job.cluster.wait_for(lambda: job.rounds_of(0) >= before + 2, 90, "rounds to be committed after the restart")
    newest = committed_rounds(job.paths, 0)[-1]
    assert newest["quorum_id"] > last_quorum, "a restarted lighthouse must never reuse a quorum id"
    assert_digests_agree(job.paths, 2)


def test_groups_with_wrong_token_job_or_model_are_refused_and_change_nothing(job_factory, tmp_path):
    job = job_factory("cluster.groups=2", "trainer.max_steps=100000")
    job.start(range(2))
    job.cluster.wait_for(lambda: job.rounds_of(0) >= 2, 120, "two committed rounds")
    real = job.cluster.job  # the resolved job: the lighthouse's real port and token
    # exec'd workers start at once (a fork server would first import for seconds), so the four
    # intruders below import side by side
    three_groups = dataclasses.replace(real.cluster, groups=3, spawn="exec")
    intruders = {
        "wrong token": dataclasses.replace(
            real,
            cluster=dataclasses.replace(
                three_groups, lighthouse=dataclasses.replace(real.cluster.lighthouse, token="nope")
            ),
        ),
        "job id": dataclasses.replace(real, name="another-job", cluster=three_groups),
        "model signature": dataclasses.replace(
            real, model=dataclasses.replace(real.model, dim=32), cluster=three_groups
        ),
        # A third group by its own cluster.groups, refused at its first heartbeat by the lighthouse's
        # count (a third group of another configuration too, before its configuration is read: that
        # refusal, by key, is tests/library/test_misuse.py's).
        "not a group of this job": dataclasses.replace(real, cluster=three_groups),
    }
    clusters = {}
    try:
        for reason, intruder in intruders.items():
            paths = RunPaths(tmp_path / reason.replace(" ", "_"))
            paths.root.mkdir()
            clusters[reason] = LocalCluster(intruder, paths, signature="unused")
            clusters[reason].start_group(2)
        for reason, cluster in clusters.items():
            worker = cluster.groups[2][0]
            assert worker.process.wait(timeout=90) != 0, f"a group with a {reason} must stop"
            assert reason in worker.log_path.read_text(), log_tail(worker.log_path)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    before = job.rounds_of(0)
    job.cluster.wait_for(lambda: job.rounds_of(0) >= before + 1, 60, "the members to keep committing")
    seen = {p for r in committed_rounds(job.paths, 0) for p in r["participants"]}
    assert seen == {"group0", "group1"}, seen


def last_step(job: Job, group: int) -> int:
    return max((r["step"] for r in read_jsonl(job.paths.metrics(group)) if "train/loss" in r), default=0)


def results(job: Job, groups: int) -> list[dict]:
    return [json.loads(job.paths.result(g).read_text()) for g in range(groups)]


def assert_one_final_model(job: Job, groups: int) -> dict:
    """Every group ended holding the state the lighthouse named as the job's end; model.pt saved once."""
    found = results(job, groups)
    ends = [r["end"] for r in found]
    assert all(e == ends[0] for e in ends) and ends[0] is not None, ends
    assert {r["digest"] for r in found} == {ends[0]["digest"]}, [(r["group"], r["rounds"]) for r in found]
    assert {r["rounds"] for r in found} == {ends[0]["round"]}
    assert job.paths.weights.exists()
    return ends[0]


def test_finished_groups_wait_for_a_straggler_which_takes_their_final_state(job_factory):
    """Group 2 hangs until groups 0 and 1 have trained to the end. They do not leave (it is
    alive) and it does not commit rounds alone from stale state: at its next sync it heals
    from a finished group in a closing round, and every group ends with one model."""
    job = job_factory("trainer.max_steps=120")
    job.start(range(3))
    job.cluster.wait_for(lambda: job.rounds_of(2) >= 3, 120, "group 2 to commit three rounds")
    job.cluster.signal_group(2, signal.SIGSTOP)
    job.cluster.wait_for(
        lambda: min(last_step(job, 0), last_step(job, 1)) >= 120, 120, "groups 0 and 1 to train to the end"
    )
    time.sleep(2 * job.job.cluster.timeouts.heartbeat)
    assert not job.cluster.finished() and job.cluster.failed_worker() is None, "finished groups must wait"
    job.cluster.signal_group(2, signal.SIGCONT)
    job.cluster.wait_for(job.cluster.finished, 120, "every group to end")
    end = assert_one_final_model(job, 3)
    # The stop may land after a round's collective and before group 2 logs it: that round is still
    # one it shared, with both others or, when one of them asked after the join wait, with the
    # other alone. What it must not log is a round no other group committed with it.
    shared = {r["round"] for g in (0, 1) for r in committed_rounds(job.paths, g) if "group2" in r["participants"]}
    alone = [r["round"] for r in committed_rounds(job.paths, 2) if r["round"] not in shared]
    assert not alone, f"group 2 committed rounds {alone} that neither group 0 nor group 1 committed with it"
    healed = [r for r in commits(job.paths, 2) if r.get("closing") and r.get("healed")]
    assert len(healed) == 1 and healed[0]["digest"] == end["digest"]
    assert_digests_agree(job.paths, 3)


def test_a_group_started_after_the_others_finished_heals_from_them(job_factory):
    """What a group killed just before the end and restarted looks like: it joins, heals from
    the groups that finished (they waited for it) and ends with their model."""
    job = job_factory("cluster.groups=2", "trainer.max_steps=40", "cluster.timeouts.start=2")
    job.start([0])
    job.cluster.wait_for(lambda: last_step(job, 0) >= 40, 120, "group 0 to train to the end alone")
    job.start([1])
    job.cluster.wait_for(job.cluster.finished, 120, "both groups to end")
    assert_one_final_model(job, 2)
    assert job.recoveries_of(1) == 1 and not committed_rounds(job.paths, 1)


def test_job_goes_on_when_every_holder_of_its_newest_state_dies(job_factory):
    """Both groups are killed at once: nobody is left holding the newest round. After a
    heartbeat timeout without a holder the restarted groups go on from the best state that
    survived (here: the initial one), numbering their rounds above every lost round."""
    job = job_factory("cluster.groups=2", "trainer.max_steps=100000")
    job.start(range(2))
    job.cluster.wait_for(lambda: min(job.rounds_of(0), job.rounds_of(1)) >= 3, 120, "three rounds committed by both")
    for g in range(2):
        job.cluster.signal_group(g, signal.SIGKILL)
    lost = max(job.rounds_of(0), job.rounds_of(1))
    for g in range(2):
        job.cluster.start_group(g)
    job.cluster.wait_for(
        lambda: min(job.rounds_of(0), job.rounds_of(1)) > lost + 1, 120, "rounds numbered above the lost ones"
    )
    restarted = [r for g in range(2) for r in committed_rounds(job.paths, g) if r["pid"] == job.leader_pid(g)]
    assert min(r["round"] for r in restarted) > lost, "a round number of the lost history was reused"
    assert_digests_agree(job.paths, 2)
    # The summary says so (run.py prints it): one loss, from the lost round.
    [loss] = state_losses({g: commits(job.paths, g) for g in range(2)})
    # Went on from the initial state: its first record after the loss is its join (step 0) or first commit (10).
    assert loss["lost_round"] == lost and loss["lost_step"] == 10 * lost and loss["went_on_from_step"] <= 10, loss
