"""Time-bounded windows (algo.window=time): the skip rule, the lighthouse's round watch, and
the outer loop with a straggler, exactly: real lighthouse, real Gloo lanes, groups as threads."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from diloco.config.base import ConfigError
from diloco.config.cluster import LighthouseConfig, QuorumRules
from diloco.config.faults import FaultsConfig
from diloco.ft.client import LighthouseClient
from diloco.ft.lighthouse import Lighthouse
from diloco.ft.quorum import QuorumBook, QuorumRequest
from diloco.schedule import fragments_to_launch, next_launch_step, skip_target
from diloco.train.inner_opt import build_inner_optimizer
from diloco.train.model import Transformer
from diloco.worker.builders import straggler_pace
from tests.conftest import compose_job
from tests.outer.test_outer import BASE, lighthouse_for, mock_inner_step, outer_for, run_threads

H = 5
TIME = ["algo.window=time", "algo.weighting=tokens"]


# -- the schedule -----------------------------------------------------------------------------
@pytest.mark.parametrize(("H_", "P", "tau"), [(10, 1, 0), (12, 4, 1), (12, 3, 2), (8, 2, 0), (100, 4, 3)])
def test_next_launch_step_is_the_first_launch_after_the_step(H_, P, tau):
    for step in range(0, 3 * H_):
        expected = next(s for s in range(step + 1, step + H_ + 1) if fragments_to_launch(s, H_, P, tau))
        assert next_launch_step(step, H_, P, tau) == expected


def test_a_group_skips_to_its_next_round_only_when_more_than_a_step_behind():
    assert skip_target(2, 10, 10, 1, 0) == 10  # eight steps behind: skip
    assert skip_target(8, 10, 10, 1, 0) == 10  # two behind: skip
    assert skip_target(9, 10, 10, 1, 0) == 9, "one step behind: take it, as the step-bounded schedule does"
    assert skip_target(10, 10, 10, 1, 0) == 10  # at the round already
    assert skip_target(3, 0, 10, 1, 0) == 3, "no round open"
    assert skip_target(3, 20, 10, 1, 0) == 3, "a round past the next one is not this window's end (heal instead)"
    assert skip_target(12, 10, 10, 1, 0) == 12, "a round already passed"
    assert skip_target(2, 5, 12, 4, 1) == 5, "streaming: launches every H/P=3 steps, τ=1 before the applies"
    assert skip_target(2, 8, 12, 4, 1) == 2, "not the next launch (5)"


# -- the lighthouse ---------------------------------------------------------------------------
def _book() -> QuorumBook:
    book = QuorumBook(QuorumRules(min_groups=2, join_timeout_s=5.0, heartbeat_timeout_s=10.0))
    for g in "ABC":
        book.heartbeat(g, 0.0)
    return book


def test_the_open_round_is_a_peers_request_past_the_askers_position():
    book = _book()
    assert book.open_round("B", (3, 40)) == 0, "nobody asked"
    book.ask(QuorumRequest("A", step=3, round_step=40), 1.0)
    assert book.open_round("B", (3, 40)) == 0, "the round B is in already"
    assert book.open_round("A", (3, 20)) == 0, "a group's own request is no news to it"
    assert book.open_round("B", (3, 20)) == 40
    assert book.open_round("B", (2, 20)) == 40, "read before B's last commit: still the peers' next round"
    book.ask(QuorumRequest("C", step=3, round_step=40, finished=True), 1.0)
    book.withdraw("A")
    assert book.open_round("B", (3, 20)) == 0, "a finished group's closing round ends no window"


def test_a_round_watch_answers_when_a_peer_asks_and_zero_when_its_wait_runs_out():
    rules = QuorumRules(min_groups=2, join_timeout_s=5.0, heartbeat_timeout_s=10.0, expected_groups=2)
    with Lighthouse(LighthouseConfig(port=0), rules, "job") as lighthouse:
        clients = {
            g: LighthouseClient(lighthouse.url, token="", job_id="job", signature="s", group=g, connect_timeout_s=5)
            for g in ("A", "B")
        }
        # 0 is the lighthouse's answer once the watch's deadline has passed on its clock (it is not stopping).
        assert clients["B"].round_open(0, 0, timeout_s=0.3) == 0
        answers: list[int] = []
        watch = threading.Thread(target=lambda: answers.append(clients["B"].round_open(0, 0, timeout_s=30)))
        watch.start()
        time.sleep(0.2)
        assert not answers, "answered before anyone asked"
        ask = threading.Thread(target=lambda: _ask_ignoring_the_answer(clients["A"]), daemon=True)
        ask.start()
        watch.join(timeout=10)
        assert answers == [20]


def _ask_ignoring_the_answer(client: LighthouseClient) -> None:
    try:
        client.quorum(0, False, 3.0, round_step=20)
    except Exception:  # noqa: BLE001 - B never asks, so this wait runs out; only the watch matters
        pass


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo=ddp", "algo.window=time", "algo.weighting=tokens"], "algo.window='time'.*algo=ddp"),
        (["algo=local", "algo.window=time", "algo.weighting=tokens"], "algo.window='time'.*algo=local"),
        (["algo.window=time"], "algo.weighting='uniform'"),
        (["algo.window=seconds"], "algo.window='seconds'"),
        (["faults.slow_group=2", "cluster.groups=2"], "faults.slow_group=2"),
        (["faults.slow_group=-2"], "faults.slow_group=-2"),
        (["faults.slowdown=0.5"], "faults.slowdown=0.5"),
    ],
)
def test_time_window_and_straggler_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_job(BASE + overrides)


def test_only_the_slow_group_is_paced_and_it_sleeps_its_extra_share(monkeypatch):
    cfg = FaultsConfig(slow_group=1, slowdown=3.0)
    assert straggler_pace(cfg, 0) is None
    assert straggler_pace(FaultsConfig(slow_group=1), 1) is None, "slowdown 1 is no straggler"
    slept: list[float] = []
    monkeypatch.setattr(straggler_pace.__module__ + ".time", SimpleNamespace(sleep=slept.append))
    straggler_pace(cfg, 1)(0.05)
    assert slept == [pytest.approx(0.1)], "after a step of 0.05 s, (3 - 1) x 0.05 s more"


# -- the outer loop -----------------------------------------------------------------------------
def _two_groups(job, tmp_path, steps: int, slow_steps: int | None = None, one_behind: bool = False):
    """Groups 0 and 1 (threads) with mock inner steps of one token each; returns models, outers,
    each group's θ_l before and after every round, and the steps group 1 jumped to.

    Equal speeds run in lockstep (a barrier after each inner step), so nobody sees a round open
    early. ``slow_steps``: group 1 takes that many steps per window, then waits until it learns
    that group 0 opened the round. ``one_behind``: group 1 waits, one step short of the window,
    until it learns of the round, and takes its last step all the same. (Barriers keep the
    threads' scheduling out of it: ``meets``.)
    """
    torch.manual_seed(0)
    models = [Transformer(job.model) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    before_round: list[list[list[torch.Tensor]]] = [[], []]
    after_round: list[list[list[torch.Tensor]]] = [[], []]
    jumps: list[int] = []
    lockstep = threading.Barrier(2)
    with lighthouse_for(job) as job:
        outers = [
            outer_for(job, g, m, build_inner_optimizer(list(m.parameters()), job.inner_opt, steps)[0], tmp_path)
            for g, m in enumerate(models)
        ]

        def learns_of_the_round(window_end: int) -> None:
            deadline = time.monotonic() + 30
            while outers[1].manager.open_round_step() != window_end:
                assert time.monotonic() < deadline, "group 1 never learned of the round group 0 opened"
                time.sleep(0.005)

        def meets(step: int, window_end: int) -> bool:
            """Where both groups wait for each other, so that neither sees a round open sooner than
            the test means: every step at equal speeds; every step but the window's last when
            group 1 is one behind; after group 1's last step of the window when it is slow."""
            if slow_steps is not None:
                return step == window_end - H + slow_steps
            return not one_behind or step != window_end

        def snapshot(g: int) -> list[torch.Tensor]:
            return [p.detach().clone() for p in models[g].parameters()]

        def group(g: int) -> None:
            outers[g].start()
            outers[g].join()
            step = 0
            while step < steps:
                step += 1
                mock_inner_step(models[g], step, scale=1.0 + g)
                window_end = next_launch_step(step - 1, H, 1, 0)
                own_last = window_end - H + slow_steps if g == 1 and slow_steps else window_end
                if meets(step, window_end):
                    lockstep.wait(timeout=30)
                if g == 1 and (step == own_last < window_end or (one_behind and step == window_end - 1)):
                    learns_of_the_round(window_end)
                if step == own_last:
                    before_round[g].append(snapshot(g))
                outcome = outers[g].after_inner_step(step, tokens=1)
                if outcome.jump_to_step is not None:
                    jumps.append(outcome.jump_to_step)
                    step = outcome.jump_to_step
                if step == window_end:
                    after_round[g].append(snapshot(g))
            outers[g].close()

        run_threads(lambda: group(0), lambda: group(1))
    return models, outers, (before_round, after_round), jumps


def _job(*overrides: str):
    return compose_job(
        BASE
        + ["cluster.groups=2", f"algo.sync_every={H}", f"trainer.max_steps={2 * H}", "outer_opt=avg", "algo.alpha=0"]
        + list(overrides)
    )


@pytest.mark.slow
def test_time_windows_at_equal_speeds_equal_step_windows_bit_for_bit(tmp_path):
    steps_job, time_job = _job("algo.weighting=tokens"), _job(*TIME)
    by_steps, _, _, no_jumps = _two_groups(steps_job, tmp_path / "steps", 2 * H)
    by_time, outers, _, jumps = _two_groups(time_job, tmp_path / "time", 2 * H)
    behind, _, _, behind_jumps = _two_groups(time_job, tmp_path / "behind", 2 * H, one_behind=True)
    assert no_jumps == jumps == behind_jumps == []
    for a, b, c in zip(by_steps[0].parameters(), by_time[0].parameters(), behind[1].parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert outers[0].group_digest() == outers[1].group_digest()


@pytest.mark.slow  # a lighthouse and its groups' rounds (~1-2 s)
def test_a_straggler_syncs_every_round_after_fewer_steps_weighted_by_its_tokens(tmp_path):
    """Group 1 takes 2 of every 5 steps; each round's θ_g is Σ tokens·θ_l / Σ tokens = (5·θ_0 + 2·θ_1)/7
    (outer_opt=avg), the same on both groups."""
    models, outers, (before, after), jumps = _two_groups(_job(*TIME), tmp_path, 2 * H, slow_steps=2)
    assert jumps == [H, 2 * H], "group 1 skipped to both rounds group 0 opened"
    assert [o.committed_here for o in outers] == [2, 2], "and committed both, with group 0"
    assert outers[0].group_digest() == outers[1].group_digest()
    assert outers[1].tokens == 4 and outers[0].tokens == 2 * H
    for r in range(2):
        for fast, slow, result0, result1 in zip(before[0][r], before[1][r], after[0][r], after[1][r]):
            torch.testing.assert_close(result0, (5 * fast + 2 * slow) / 7, rtol=0, atol=1e-5)
            assert torch.equal(result0, result1)
