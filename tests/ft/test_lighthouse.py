"""The lighthouse over real HTTP on 127.0.0.1: quorums, refusals, status, restarts, the store.

Every wait is bounded: clients carry short timeouts and every helper thread is joined with
a deadline, so a regression fails a test instead of hanging the suite. Those deadlines are hang
guards, not measurements: no test asserts how long anything took. Where a timeout is the
subject, the lighthouse runs on a ``ManualClock`` that the test moves, or the answer's code and
reason say which path was taken.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist

from diloco.config.base import ConfigError
from diloco.config.cluster import LighthouseConfig, QuorumRules
from diloco.ft import status_page
from diloco.ft.client import LighthouseClient
from diloco.ft.lane_watch import LaneWatcher
from diloco.ft.lanes import CancelScope, LaneCancel, LaneError, Lanes, wait_work
from diloco.ft.lighthouse import Lighthouse, formed_line, save_page
from diloco.ft.manager import JobEndedError, Manager
from diloco.ft.protocol import (
    ErrorCode,
    GroupProgress,
    LaneWatch,
    LighthouseRefused,
    LighthouseUnavailable,
    QuorumAsk,
    QuorumSuperseded,
    QuorumTimeout,
)
from diloco.ft.quorum import JobEnd, Quorum, QuorumBook
from tests.conftest import NO_PROXY, REPO
from tests.hang_guard import in_thread

JOB, SIG, TOKEN = "job-1", "sig-abc", "s3cret"
FAST = QuorumRules(min_groups=1, join_timeout_s=0.3, heartbeat_timeout_s=1.0)


@pytest.fixture
def start():
    """``start(rules, job_config=..., **cfg)`` -> a running lighthouse on a free port, stopped after the test."""
    started = []

    def make(
        rules: QuorumRules = FAST,
        signature: str | None = SIG,
        clock: Callable[[], float] = time.monotonic,
        job_config: dict | None = None,
        **cfg,
    ) -> Lighthouse:
        config = LighthouseConfig(**{"port": 0, "token": TOKEN, **cfg})
        lh = Lighthouse(config, rules, JOB, signature, clock=clock, job_config=job_config)
        lh.start()
        started.append(lh)
        return lh

    yield make
    for lh in started:
        lh.stop()


def client(lh: Lighthouse | None, group: str, url: str = "", **over) -> LighthouseClient:
    kw = {"token": TOKEN, "job_id": JOB, "signature": SIG, "group": group, "connect_timeout_s": 1.0, **over}
    return LighthouseClient(url or lh.url, **kw)


def ask_all(
    lh: Lighthouse,
    steps: dict[str, int | tuple[int, int]],
    timeout_s: float = 3.0,
    failed: tuple[str, ...] = (),
    clients: dict[str, LighthouseClient] | None = None,
) -> dict:
    """Every group asks at once (in threads, through ``clients`` or a new client each) at a step or
    (step, round_step); group -> (Quorum, store) or the exception raised."""
    results: dict = {}

    def ask(group: str, position: int | tuple[int, int]) -> None:
        step, round_step = position if isinstance(position, tuple) else (position, 0)
        asker = client(lh, group) if clients is None else clients[group]
        try:
            results[group] = asker.quorum(step, group in failed, timeout_s, round_step=round_step)
        except Exception as e:  # noqa: BLE001 (the test inspects it)
            results[group] = e

    threads = [threading.Thread(target=ask, args=item, daemon=True) for item in steps.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 2.0)
        assert not t.is_alive(), "a quorum request outlived its timeout"
    return results


def quorums(results: dict) -> dict:
    for group, r in results.items():
        assert isinstance(r, tuple), f"group {group} got {r!r}"
    return {g: r[0] for g, r in results.items()}


def beat(lh: Lighthouse, groups, step: int = 0, quorum_id: int = 0) -> None:
    for g in groups:
        client(lh, g).heartbeat(step, quorum_id)


def get(lh: Lighthouse, path: str) -> tuple[int, bytes]:
    try:
        with NO_PROXY.open(lh.url + path, timeout=2.0) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(lh: Lighthouse, path: str, body: bytes, token: str = TOKEN) -> tuple[int, dict]:
    req = urllib.request.Request(lh.url + path, data=body, method="POST", headers={"Authorization": f"Bearer {token}"})
    try:
        with NO_PROXY.open(req, timeout=2.0) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def status(lh: Lighthouse) -> dict:
    code, body = get(lh, "/status")
    assert code == 200
    return json.loads(body)


def membership(lh: Lighthouse) -> dict:
    """The parts of /status a refused request must leave alone (not the clock-driven ages)."""
    s = status(lh)
    groups = [(g["id"], g["step"], g["healthy"], g["waiting_for_quorum"]) for g in s["groups"]]
    current = s["quorum"] and {k: v for k, v in s["quorum"].items() if k != "age_s"}
    return {"groups": groups, "quorum": current, "history": s["history"], "signature": s["model_signature"]}


def wait_until(predicate, timeout_s: float = 2.0) -> None:
    """A hang guard: poll until ``predicate`` holds; failing after ``timeout_s`` rather than hanging."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class ManualClock:
    """The lighthouse's clock, moved only by the test: no timeout passes until it says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def waiting(lh: Lighthouse) -> set[str]:
    """The groups whose quorum request is open, as /status shows them."""
    return {g["id"] for g in status(lh)["groups"] if g["waiting_for_quorum"]}


def outcome(call: Callable[[], object]) -> object:
    """What ``call`` returns or raises, under ``in_thread``'s hang guard."""
    return in_thread(call)()


# -- quorums -------------------------------------------------------------------------------
def test_three_groups_get_one_quorum_with_healing(start):
    lh = start(QuorumRules(min_groups=1, join_timeout_s=2.0, heartbeat_timeout_s=5.0))  # all ask: no waiting
    beat(lh, "ABC")
    got = quorums(ask_all(lh, {"A": 5, "B": 5, "C": 3}))
    assert len({(q.quorum_id, q.participants) for q in got.values()}) == 1
    q = got["A"]
    assert q.participants == ("A", "B", "C") and q.max_step == 5 and q.heal_from == {"C": "A"}
    assert got["A"] == got["B"] == got["C"]


def test_groups_level_in_rounds_at_different_inner_steps_heal_to_the_furthest(start):
    """After an outage groups can hold one round at different inner steps (other fragments due)."""
    lh = start(QuorumRules(min_groups=1, join_timeout_s=2.0, heartbeat_timeout_s=5.0))
    beat(lh, "ABC", step=11)
    got = quorums(ask_all(lh, {"A": (11, 120), "B": (11, 130), "C": (11, 130)}))
    assert got["A"].max_step == 11 and got["A"].heal_from == {"A": "B"}


def test_same_members_asking_again_keep_the_id_without_waiting(start):
    lh = start(QuorumRules(min_groups=1, join_timeout_s=600.0, heartbeat_timeout_s=600.0))
    beat(lh, "ABC")
    first = quorums(ask_all(lh, {"A": 0, "B": 0, "C": 0}))["A"]
    beat(lh, "D")  # healthy but not asking: only the fast path answers before the join timeout
    again = quorums(ask_all(lh, {"A": 1, "B": 1, "C": 1}, timeout_s=30.0))  # else: a timeout, and quorums() fails
    assert {q.quorum_id for q in again.values()} == {first.quorum_id}
    assert again["A"].participants == ("A", "B", "C") and again["A"].max_step == 1


class _AnswersKept(LighthouseClient):
    """A client that keeps every 200 answer's JSON as it came."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.answers: list = []

    def _post(self, message, timeout_s: float):
        answer = super()._post(message, timeout_s)
        self.answers.append(answer)
        return answer


def test_a_grant_of_the_quorum_a_group_holds_leaves_its_participants_out(start):
    """One id always names the same members, so a group asking with the quorum it holds is
    granted it without the participants (12 KB to each of 1,000 groups); a new id names them again."""
    lh = start()
    kw = {"token": TOKEN, "job_id": JOB, "signature": SIG, "connect_timeout_s": 1.0}
    clients = {g: _AnswersKept(lh.url, group=g, **kw) for g in "AB"}
    beat(lh, "AB")
    rounds = [quorums(ask_all(lh, {"A": 1, "B": 1}, clients=clients))]
    rounds.append(quorums(ask_all(lh, {"A": 2, "B": 2}, clients=clients)))
    rounds.append(quorums(ask_all(lh, {"A": 3, "B": 3}, failed=("B",), clients=clients)))  # a new id
    assert [r["A"].quorum_id for r in rounds] == [1, 1, 2]
    for group, asker in clients.items():
        grants = [answer["quorum"] for answer in asker.answers]
        assert ["participants" in g for g in grants] == [True, False, True], group
        assert grants[1]["members"] == 2
        assert all(r[group].participants == ("A", "B") for r in rounds)
        assert rounds[1][group].max_step == 2


def test_a_silent_member_is_left_out_after_the_join_timeout(start):
    clock = ManualClock()
    lh = start(clock=clock)
    beat(lh, "ABC")
    first = quorums(ask_all(lh, {"A": 0, "B": 0, "C": 0}))["A"]
    asked: dict = {}
    askers = threading.Thread(target=lambda: asked.update(ask_all(lh, {"A": 1, "B": 1})), daemon=True)
    askers.start()  # C is still healthy but does not ask
    # A majority asks, yet while the clock stands still no quorum forms: both requests stay open.
    wait_until(lambda: waiting(lh) == {"A", "B"})
    clock.advance(FAST.join_timeout_s)  # C stays healthy: FAST's heartbeat timeout is longer
    askers.join(60.0)
    assert not askers.is_alive(), "no answer after the join timeout passed"
    got = quorums(asked)
    assert got["A"] == got["B"]
    assert got["A"].participants == ("A", "B") and got["A"].quorum_id == first.quorum_id + 1


def test_a_late_joiner_gets_a_new_id_and_heals(start):
    lh = start(QuorumRules(min_groups=1, join_timeout_s=2.0, heartbeat_timeout_s=5.0))
    beat(lh, "AB")
    first = quorums(ask_all(lh, {"A": 4, "B": 4}))["A"]
    beat(lh, "J")
    late: dict = {}
    joiner = threading.Thread(target=lambda: late.update(ask_all(lh, {"J": 0})), daemon=True)
    joiner.start()
    wait_until(lambda: any(g["id"] == "J" and g["waiting_for_quorum"] for g in status(lh)["groups"]))
    got = quorums(ask_all(lh, {"A": 4, "B": 4}))
    joiner.join(3.0)
    got.update(quorums(late))
    assert len({(q.quorum_id, q.participants, q.max_step) for q in got.values()}) == 1
    q = got["J"]
    assert q.quorum_id == first.quorum_id + 1 and q.participants == ("A", "B", "J")
    assert q.max_step == 4 and q.heal_from == {"J": "A"}


def test_a_failed_commit_forces_a_new_id(start):
    lh = start()
    beat(lh, "AB")
    first = quorums(ask_all(lh, {"A": 0, "B": 0}))["A"]
    got = quorums(ask_all(lh, {"A": 0, "B": 1}, failed=("A",)))
    assert got["A"] == got["B"] and got["A"].quorum_id == first.quorum_id + 1
    assert got["A"].heal_from == {"A": "B"}


def test_too_few_groups_time_out_and_the_request_is_withdrawn(start):
    clock = ManualClock()
    lh = start(QuorumRules(min_groups=2, join_timeout_s=0.1, heartbeat_timeout_s=5.0), clock=clock)
    patient = {"connect_timeout_s": 600.0}  # the client's own limit (timeout + connect) never ends a wait here
    answer = in_thread(lambda: client(lh, "A", **patient).quorum(0, False, timeout_s=0.4))
    wait_until(lambda: waiting(lh) == {"A"})  # open: the lighthouse's clock has not reached 0.4 s
    clock.advance(0.4)
    timed_out = answer()
    assert isinstance(timed_out, QuorumTimeout) and timed_out.code is ErrorCode.TIMEOUT, timed_out
    assert re.match(r"no quorum within 0.4 s: healthy groups \['A'\], asked \['A'\]", str(timed_out)), timed_out
    assert [(g["id"], g["waiting_for_quorum"]) for g in status(lh)["groups"]] == [("A", False)]
    # Withdrawn, not merely forgotten by the client: B alone is still short of min_groups=2.
    late = in_thread(lambda: client(lh, "B", **patient).quorum(0, False, timeout_s=0.3))
    wait_until(lambda: waiting(lh) == {"B"})
    clock.advance(0.3)
    assert isinstance(late(), QuorumTimeout)


def test_a_request_whose_group_stops_heartbeating_is_dropped(start):
    lh = start(QuorumRules(min_groups=2, join_timeout_s=0.1, heartbeat_timeout_s=0.3))
    with pytest.raises(QuorumTimeout, match="no heartbeat for cluster.timeouts.heartbeat=0.3 s") as timeout:
        client(lh, "A").quorum(0, False, timeout_s=60.0)
    assert timeout.value.code is ErrorCode.WITHDRAWN  # dropped by the lighthouse, long before its own timeout


def test_a_second_request_from_the_same_group_supersedes_the_first(start):
    lh = start(QuorumRules(min_groups=2, join_timeout_s=0.1, heartbeat_timeout_s=5.0))
    beat(lh, "AB")
    early: dict = {}
    late: dict = {}
    # The first request would wait 600 s: only the second one can end it within the hang guard.
    first = threading.Thread(target=lambda: early.update(ask_all(lh, {"A": 0}, timeout_s=600.0)), daemon=True)
    first.start()
    wait_until(lambda: waiting(lh) == {"A"})
    second = threading.Thread(target=lambda: late.update(ask_all(lh, {"A": 1})), daemon=True)
    second.start()
    first.join(60.0)
    assert not first.is_alive(), "the first request was not answered when the second arrived"
    assert isinstance(early["A"], QuorumSuperseded) and not isinstance(early["A"], LighthouseRefused)
    assert early["A"].code is ErrorCode.SUPERSEDED and early["A"].status == 409
    got = quorums(ask_all(lh, {"B": 1}))
    second.join(60.0)
    assert not second.is_alive(), "the second request got no quorum with B"
    got.update(quorums(late))
    assert got["A"] == got["B"] and got["A"].participants == ("A", "B") and got["A"].max_step == 1


def test_stop_answers_open_long_polls_at_once(start):
    """A request that would wait 600 s (the lighthouse caps it at MAX_POLL_S) is answered by stop():
    the thread returns within its hang guard, with the lighthouse's "stopping", not a timeout."""
    lh = start(QuorumRules(min_groups=2, join_timeout_s=0.1, heartbeat_timeout_s=5.0))
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(ask_all(lh, {"A": 0}, timeout_s=600.0)), daemon=True)
    t.start()
    wait_until(lambda: waiting(lh) == {"A"})
    lh.stop()
    t.join(60.0)
    assert not t.is_alive(), "the open long poll was not answered by stop()"
    assert isinstance(result["A"], LighthouseUnavailable) and "stopping" in str(result["A"])


def raw_post(lh: Lighthouse, message) -> socket.socket:
    """POST ``message`` (a protocol message) on a socket left open, its answer unread."""
    body = json.dumps(message.to_json()).encode()
    sock = socket.create_connection(("127.0.0.1", lh.port), timeout=2.0)
    head = f"POST {message.path} HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def abandon(sock: socket.socket) -> None:
    """Leave at once, resetting the connection: writing the answer then fails."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.slow  # a lighthouse and its groups' rounds (~1-2 s)
def test_open_long_polls_hold_no_thread_and_answers_nobody_reads_break_nothing(start):
    """Open requests are parked with the HTTP front, not given a thread each; the answers to a quorum
    request and a lane watch whose clients left go nowhere, and the lighthouse goes on serving."""
    lh = start(QuorumRules(min_groups=21, join_timeout_s=0.1, heartbeat_timeout_s=5.0))
    before = threading.active_count()
    asks = {
        f"g{i}": raw_post(lh, QuorumAsk(JOB, SIG, f"g{i}", step=0, commit_failed=False, timeout_s=30.0))
        for i in range(20)
    }
    wait_until(lambda: waiting(lh) == set(asks))
    wait_until(lambda: threading.active_count() <= before)  # the status page's threads end; no poll holds one
    for sock in asks.values():
        abandon(sock)
    last = raw_post(lh, QuorumAsk(JOB, SIG, "g20", step=0, commit_failed=False, timeout_s=30.0))
    grant = json.loads(last.makefile("rb").read().partition(b"\r\n\r\n")[2])
    last.close()
    assert set(grant["quorum"]["participants"]) == {*asks, "g20"}
    watch = raw_post(lh, LaneWatch(JOB, SIG, "g0", round_id=grant["quorum"]["round_id"], timeout_s=1.5))
    wait_until(lambda: lh.open_polls() == 1)
    abandon(watch)
    assert lh.wait_replies_sent(0.0), "a parked poll is no answer in flight: a leaving lighthouse waits not for it"
    wait_until(lambda: lh.open_polls() == 0, timeout_s=5.0)  # its wait ran out: the answer went nowhere
    assert lh.wait_replies_sent(timeout_s=3.0)
    beat(lh, grant["quorum"]["participants"], step=1)
    got = quorums(ask_all(lh, dict.fromkeys(grant["quorum"]["participants"], 1)))
    assert {q.max_step for q in got.values()} == {1} and len(got) == 21


def test_a_lane_watch_is_held_across_rounds_and_answered_when_a_later_round_loses_a_member(start):
    """A group that asks again and is granted its next round leaves its watch open: one answer per
    group and round was half of what the lighthouse wrote in a round's burst at 1,000 groups.
    The watch then answers for the round granted later."""
    lh = start(QuorumRules(min_groups=2, join_timeout_s=10.0, heartbeat_timeout_s=30.0))
    first = quorums(ask_all(lh, {"A": 0, "B": 0}))["A"].round_id
    watch = raw_post(lh, LaneWatch(JOB, SIG, "A", round_id=first, timeout_s=30.0))
    wait_until(lambda: lh.open_polls() == 1)
    second = quorums(ask_all(lh, {"A": 1, "B": 1}))["A"].round_id
    time.sleep(0.2)  # ten decisions
    assert second > first and not select.select([watch], [], [], 0)[0], "answered as A moved on"
    client(lh, "B").recovery(wait_ms=0)  # B died: the round A holds now breaks
    watch.settimeout(2.0)
    news = json.loads(watch.makefile("rb").read().partition(b"\r\n\r\n")[2])
    watch.close()
    assert news == {
        "round_id": second,
        "broken": f"group B left round {second}: it departed (its process died)",
        "gone": ["B"],
    }


# -- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "code", "message"),
    [
        (
            {"token": "guess"},
            401,
            "wrong token: the request's token does not match the lighthouse's; give every part of the job the "
            "same cluster.lighthouse.token_file (or DILOCO_LIGHTHOUSE_TOKEN)",
        ),
        ({"token": ""}, 401, "missing token"),
        ({"job_id": "other"}, 409, "job id 'other' differs from this lighthouse's job 'job-1'"),
        (
            {"signature": "sig-xyz"},
            409,
            "model signature sig-xyz differs from the job's sig-abc: "
            "the group's model differs (its config, or its parameters' names, shapes or dtypes)",
        ),
    ],
)
def test_refusals_name_the_problem_and_change_nothing(start, override, code, message):
    lh = start()
    beat(lh, "AB")
    quorums(ask_all(lh, {"A": 3, "B": 3}))
    before = membership(lh)
    for intruder in ("A", "X"):  # a known member and a stranger
        bad = client(lh, intruder, **override)
        with pytest.raises(LighthouseRefused) as refused:
            bad.heartbeat(99, 1000)
        assert refused.value.status == code and str(refused.value).startswith(message)
        assert refused.value.code is (ErrorCode.BAD_TOKEN if code == 401 else ErrorCode.WRONG_JOB)
        with pytest.raises(LighthouseRefused, match=re.escape(message)):
            bad.quorum(99, True, timeout_s=0.5)
    assert membership(lh) == before


def test_the_first_accepted_request_pins_the_model_signature(start):
    lh = start(signature=None)
    with pytest.raises(LighthouseRefused):
        client(lh, "A", token="guess").heartbeat(0, 0)  # refused: pins nothing
    assert status(lh)["model_signature"] is None
    client(lh, "A").heartbeat(0, 0)
    assert status(lh)["model_signature"] == SIG
    with pytest.raises(LighthouseRefused, match="model signature other differs from the job's sig-abc"):
        client(lh, "B", signature="other").heartbeat(0, 0)


def test_a_group_with_another_training_config_is_refused_naming_the_keys(start):
    lh = start()
    job = {"algo.sync_every": 50, "algo.name": "diloco", "trainer.max_steps": 500}
    quorums({"A": client(lh, "A", config=job).quorum(0, False, timeout_s=2.0)})
    other = {**job, "algo.sync_every": 25, "trainer.max_steps": 400}
    with pytest.raises(LighthouseRefused) as refused:
        client(lh, "B", config=other).quorum(0, False, timeout_s=2.0)
    assert refused.value.status == 409
    assert "differs from the job's in 2 key(s): algo.sync_every: job 50, this group 25; " in str(refused.value)
    assert "trainer.max_steps: job 500, this group 400" in str(refused.value)
    assert [g["id"] for g in status(lh)["groups"]] == ["A"]  # B left no trace


def test_a_granted_group_asks_with_its_configs_digest_and_a_lighthouse_restarted_for_another_job_refuses_it(start):
    """Once granted, a group's asks carry its configuration's digest instead of the 2 KB
    configuration; a lighthouse whose job has another configuration refuses the digest."""
    job = {"algo.sync_every": 50, "algo.name": "diloco"}
    lh = start(job_config=job)
    a = client(lh, "A", config=job)
    quorums({"A": a.quorum(0, False, timeout_s=2.0)})
    quorums({"A": a.quorum(1, False, timeout_s=2.0)})  # by digest
    port = lh.port
    lh.stop()
    again = start(port=port, job_config={**job, "algo.sync_every": 25})
    with pytest.raises(LighthouseRefused, match=r"configuration \(digest \w+\) differs from the job's"):
        a.quorum(2, False, timeout_s=2.0)
    assert status(again)["groups"] == []


def test_after_the_end_finished_groups_learn_it_and_late_groups_are_refused(start):
    lh = start(QuorumRules(min_groups=1, join_timeout_s=0.3, heartbeat_timeout_s=5.0, expected_groups=2))
    quorums(ask_all(lh, {"A": 0, "B": 0}))
    ends: dict = {}

    def finish(group: str, step: int) -> None:
        ends[group] = client(lh, group).quorum(step, False, timeout_s=3.0, finished=True, digest=f"d{step}")

    first = threading.Thread(target=finish, args=("A", 4), daemon=True)
    first.start()
    wait_until(lambda: waiting(lh) == {"A"})
    assert lh.ended is None and not ends  # A waits for B to finish
    finish("B", 4)
    first.join(3.0)
    assert ends["A"] == ends["B"] == JobEnd(round=4, digest="d4", holders=("A", "B"))
    assert status(lh)["ended"] == {"round": 4, "digest": "d4", "holders": ["A", "B"]} and lh.served_end()
    with pytest.raises(LighthouseRefused, match="the job ended at round 4 .* group 'C' did not finish") as refused:
        client(lh, "C").quorum(0, False, timeout_s=1.0)
    assert refused.value.code is ErrorCode.JOB_ENDED
    # A late group's manager raises JobEndedError (its worker exits JOB_ENDED_EXIT_CODE: too late, no crash).
    lanes = Lanes(local_rank=0, connect_timeout_s=1.0, collective_timeout_s=1.0)
    late = Manager(
        group="C", inner_pg=None, client=client(lh, "C"), lanes=lanes, quorum_timeout_s=1.0, heartbeat_interval_s=1.0
    )
    with pytest.raises(JobEndedError, match="the job ended at round 4"):
        late.start_round(0)


def test_a_finished_groups_wait_that_runs_out_says_when_the_job_ends_not_what_a_quorum_needs(start):
    clock = ManualClock()
    rules = QuorumRules(min_groups=1, join_timeout_s=0.1, heartbeat_timeout_s=60.0, expected_groups=2, end_timeout_s=30)
    lh = start(rules, clock=clock)
    beat(lh, "AB")
    patient = {"connect_timeout_s": 600.0}
    answer = in_thread(lambda: client(lh, "A", **patient).quorum(8, False, timeout_s=0.4, finished=True, digest="d8"))
    wait_until(lambda: waiting(lh) == {"A"})
    clock.advance(0.4)
    said = str(answer())
    assert said == (
        "the job has not ended: groups ['A'] finished, ['B'] train on; it ends once every group finished, "
        "or in 30 s (cluster.timeouts.end=30 s after the first finished)"
    ), said


def test_a_restarted_group_heals_from_finished_groups_that_wait_for_it(start):
    lh = start(QuorumRules(min_groups=1, join_timeout_s=0.3, heartbeat_timeout_s=5.0, expected_groups=2))
    quorums(ask_all(lh, {"A": 0, "B": 0}))
    got: dict = {}
    waiting = threading.Thread(
        target=lambda: got.update(A=client(lh, "A").quorum(6, False, timeout_s=3.0, finished=True, digest="d6")),
        daemon=True,
    )
    waiting.start()
    quorum, _ = client(lh, "B").quorum(0, False, timeout_s=3.0)  # B was killed: its new process asks at 0
    waiting.join(3.0)
    assert quorum.closing and quorum.heal_from == {"B": "A"} and got["A"][0] == quorum
    assert lh.ended is None


def test_an_empty_token_means_none_is_required(start):
    lh = start(token="")
    client(lh, "A", token="").heartbeat(0, 0)
    client(lh, "B", token="anything").heartbeat(0, 0)
    assert [g["id"] for g in status(lh)["groups"]] == ["A", "B"]


def test_malformed_requests_get_400_and_unknown_paths_404(start):
    lh = start()
    good = {"job": JOB, "signature": SIG, "group": "A", "step": 1, "quorum_id": 0}
    assert post(lh, "/heartbeat", json.dumps(good).encode()) == (200, {"ok": True})
    cases = {
        b"{not json": "malformed JSON",
        b"[1, 2]": "must be a JSON object",
        json.dumps({**good, "step": "1"}).encode(): "'step'='1' must be a non-negative integer",
        json.dumps({**good, "step": True}).encode(): "must be a non-negative integer",
        json.dumps({k: v for k, v in good.items() if k != "group"}).encode(): "missing field 'group'",
        json.dumps({**good, "group": ""}).encode(): "'group' must be 1 to",
        json.dumps({**good, "extra": 1}).encode(): "unknown field 'extra'",
        json.dumps({**good, "pad": "x" * 70_000}).encode(): "exceeds the limit",
    }
    for body, message in cases.items():
        code, answer = post(lh, "/heartbeat", body)
        assert code == 400 and message in answer["error"] and answer["code"] == "bad_request", (body[:40], answer)
    ask = {**good, "commit_failed": False, "timeout_s": -1}
    del ask["quorum_id"]
    code, answer = post(lh, "/quorum", json.dumps(ask).encode())
    assert code == 400 and "'timeout_s'=-1 must be a positive number" in answer["error"]
    assert post(lh, "/nope", b"{}") == (
        404,
        {
            "error": "unknown path '/nope': POST /heartbeat or /quorum or /round_open or /recovery or /lane_watch "
            "or /commit",
            "code": "not_found",
        },
    )
    code, answer = get(lh, "/nope")
    assert code == 404 and json.loads(answer)["code"] == "not_found"
    assert [g["id"] for g in status(lh)["groups"]] == ["A"]


def test_a_body_nested_too_deep_gets_400_with_one_line_and_no_traceback(start, capfd):
    """30,000 brackets under the size limit, with the right token, raised RecursionError in the
    parser: a traceback in the lighthouse's log and no answer."""
    lh = start()
    good = {"job": JOB, "signature": SIG, "group": "A", "step": 1, "quorum_id": 0}
    bodies = {
        "/heartbeat": b"[" * 30_000,
        "/quorum": b'{"config": ' * 5_000,
        "/round_open": b'[{"a": [' * 5_000,
        "/recovery": b"[" * 33 + b"]" * 33,
    }
    for path, body in bodies.items():
        code, answer = post(lh, path, body)
        assert code == 400 and answer["code"] == "bad_request", (path, answer)
        assert re.fullmatch(r"malformed JSON body: nested \d+ levels deep, over the limit of 32", answer["error"])
    assert post(lh, "/heartbeat", json.dumps(good).encode()) == (200, {"ok": True})  # still serving
    assert "Traceback" not in capfd.readouterr().err


def test_a_lighthouse_beyond_loopback_needs_a_token():
    for host in ("0.0.0.0", "::", "192.0.2.1", "lighthouse.example"):
        with pytest.raises(ConfigError, match=f"cluster.lighthouse.host='{re.escape(host)}': listens beyond loopback"):
            Lighthouse(LighthouseConfig(host=host, port=0), FAST, JOB)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        LighthouseConfig(host=host).check_bind()
    LighthouseConfig(host="0.0.0.0", token=TOKEN).check_bind()


# -- status --------------------------------------------------------------------------------
def test_status_json_and_html_page(start):
    clock = ManualClock()
    lh = start(clock=clock)
    evil = "<script>alert(1)</script>"
    beat(lh, ["A", evil], step=7)
    before = time.time()
    quorums(ask_all(lh, {"A": 7, evil: 6}))
    clock.advance(0.25)
    beat(lh, ["A"], step=8, quorum_id=1)
    s = status(lh)
    after = time.time()  # the grants are stamped as sent after the answers go out, so not before the asker reads them
    assert s["job"] == JOB and s["model_signature"] == SIG and "token" not in json.dumps(s)
    assert s["rules"] == dataclasses.asdict(FAST) and s["ended"] is None
    groups = {g["id"]: g for g in s["groups"]}
    assert set(groups) == {"A", evil}
    assert groups["A"]["step"] == 8 and groups[evil]["step"] == 6
    assert all(g["healthy"] and not g["waiting_for_quorum"] for g in s["groups"])
    assert {g["id"]: g["since_heartbeat_s"] for g in s["groups"]} == {"A": 0.0, evil: 0.25}  # on the lighthouse's clock
    assert s["quorum"]["participants"] == sorted(["A", evil]) and s["quorum"]["heal_from"] == {evil: "A"}
    assert s["quorum"]["age_s"] == 0.25 and len(s["history"]) == 1 and s["history"][0]["max_step"] == 7
    formed = s["history"][0]
    assert before <= formed["formed_at"] <= formed["grants_sent_at"] <= after, "history is stamped with the wall clock"
    code, page = get(lh, "/")
    html = page.decode()
    assert code == 200 and '<meta http-equiv="refresh" content="2">' in html
    assert "<td>A</td>" in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html and evil not in html
    assert JOB in html and SIG in html and TOKEN not in html
    assert get(lh, "/alive") == (200, json.dumps({"pid": os.getpid()}).encode()) and s["pid"] == os.getpid()


def test_a_status_snapshot_is_unchanged_by_what_the_lighthouse_hears_after_it():
    """/status is built from a snapshot taken under the lock and encoded after it is released: the
    snapshot must not share the lighthouse's live containers, or a heartbeat arriving meanwhile
    changes (or, a dict resized mid-iteration, breaks) the answer being built."""
    book, board = QuorumBook(FAST, started_at=0.0), status_page.StatusBoard()
    book.heartbeat("A", 1.0, step=3)
    board.progress("A", GroupProgress(inner_step=3, train_loss=2.0))
    history = collections.deque([{"quorum_id": 1}])
    snap = status_page.snapshot(JOB, SIG, book, {"A": 3}, None, history, 1.0, board)
    before = status_page.build_status(snap)
    book.heartbeat("B", 1.5, step=4)
    board.progress("A", GroupProgress(inner_step=9, train_loss=1.0))
    board.progress("B", GroupProgress(inner_step=4, train_loss=3.0))
    board.event("joined", "B")
    history.append({"quorum_id": 2})
    history[0]["grants_sent_at"] = 2.0
    after = status_page.build_status(snap)
    assert [g["id"] for g in after["groups"]] == ["A"] and after["curves"] == {"A": [(3, 2.0)]}
    assert after["history"] == [{"quorum_id": 1}] and after["timeline"] == []
    assert {k: v for k, v in after.items() if k != "now"} == {k: v for k, v in before.items() if k != "now"}


def _report(lh: Lighthouse, group: str, inner_step: int, loss: float, digest: str = "", committed: int = 0) -> None:
    progress = GroupProgress(inner_step=inner_step, train_loss=loss, tokens_per_s=1234.0, digest=digest)
    client(lh, group).heartbeat(committed, 0, progress=progress)


def test_the_page_shows_each_groups_progress_a_loss_curve_and_a_timeline(start):
    lh = start()
    evil = "<b>x</b>"
    beat(lh, ["A", evil])
    quorums(ask_all(lh, {"A": 1, evil: 0}))  # evil is behind: it heals from A
    for step, loss in ((10, 3.0), (20, 2.5), (30, 2.0)):
        _report(lh, "A", step, loss, digest="d" * 64, committed=1)
        _report(lh, evil, step, loss + 0.1)
    wait_until(lambda: {e["kind"] for e in status(lh)["timeline"]} >= {"joined", "heal"})
    s = status(lh)
    groups = {g["id"]: g for g in s["groups"]}
    assert groups["A"]["inner_step"] == 30 and groups["A"]["train_loss"] == 2.0 and groups["A"]["digest"] == "d" * 64
    assert groups["A"]["tokens_per_s"] == 1234.0 and "digest" not in groups[evil]
    assert s["curves"]["A"] == [[10, 3.0], [20, 2.5], [30, 2.0]]
    assert {(e["kind"], e["group"]) for e in s["timeline"]} >= {("joined", "A"), ("joined", evil), ("heal", evil)}
    html = get(lh, "/")[1].decode()
    assert html.count("<polyline") == 2 and "<svg" in html and "<circle" in html
    assert "&lt;b&gt;x&lt;/b&gt;" in html and evil not in html
    assert "dddddddddddd" in html and "1,234" in html  # the digest (short) and tokens/s in the groups table

    ended = s | {"ended": {"round": 4, "digest": "d4", "holders": ["A", evil]}}
    assert "the job ended at round 4</b>; saved by A, &lt;b&gt;" in status_page.render_html(ended)


def test_the_saved_page_is_the_drawing_with_its_data_inlined_asking_nothing_of_the_lighthouse(start, tmp_path):
    """What a run leaves in status.html: it opens from disk once the lighthouse is gone, and holds
    no token (a secret never reaches a file)."""
    lh = start()
    evil = "</script><b>x</b>"
    beat(lh, ["A", evil])
    quorums(ask_all(lh, {"A": 1, evil: 0}))
    for step, loss in ((10, 3.0), (20, 2.5)):
        _report(lh, "A", step, loss)
        _report(lh, evil, step, loss + 0.1)
    save_page(lh, tmp_path / "status.html")
    html = (tmp_path / "status.html").read_text()
    assert html.count("<svg") == 2 and html.count("<polyline") == 2 and "<circle" in html, "both drawings"
    asks = ("http-equiv", "href=", "src=", "fetch(", "XMLHttpRequest", lh.url)
    assert not [found for found in asks if found in html], "a saved page asks the gone lighthouse for nothing"
    assert html.count("</script>") == 1, "a group id cannot end the inlined data early"
    data = re.search(r'<script type="application/json" id="status">(.*?)</script>', html, re.DOTALL).group(1)
    inlined = json.loads(data)
    assert inlined["curves"]["A"] == [[10, 3.0], [20, 2.5]] and {g["id"] for g in inlined["groups"]} == {"A", evil}
    assert TOKEN not in html and lh.cfg.token == TOKEN


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell")


@pytest.mark.slow
def test_the_page_renders_in_a_real_headless_browser(start, tmp_path):
    """Debian's chromium (``apt install chromium``) loads the page and builds the groups table,
    both SVG drawings and the refresh; skipped where no such browser is installed."""
    browser = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    if browser is None:
        pytest.skip(f"no headless browser here (looked for {', '.join(BROWSERS)})")
    lh = start()
    beat(lh, "AB")
    quorums(ask_all(lh, {"A": 1, "B": 0}))
    for step, loss in ((10, 3.0), (20, 2.5)):
        _report(lh, "A", step, loss, digest="e" * 64)
        _report(lh, "B", step, loss + 0.2)
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(
        [*command, "--dump-dom", lh.url + "/"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "lighthouse: job" in dom and dom.count("<polyline") == 2 and dom.count("<svg") == 2, dom[:2000]
    assert "<td>eeeeeeeeeeee</td>" in dom and "<circle" in dom
    subprocess.run(
        [*command, f"--screenshot={tmp_path / 'page.png'}", "--window-size=1000,1400", lh.url + "/"],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert (tmp_path / "page.png").stat().st_size > 10_000, "a page with drawings, not a blank one"


def test_a_loss_curve_keeps_the_whole_run_in_bounded_points():
    curve = status_page.Curve(limit=8)
    for step in range(1, 101):
        curve.add(step, 1.0 / step)
    assert len(curve.points) <= 8 and curve.points[0][0] == 1 and curve.points[-1][0] > 50
    curve.add(curve.points[-1][0], 0.0)
    assert curve.points[-1][1] != 0.0, "a repeated step adds nothing"
    middle = curve.points[len(curve.points) // 2][0]
    kept = [point for point in curve.points if point[0] < middle]
    curve.add(middle, 4.0)
    assert curve.points == [*kept, (middle, 4.0)], "a group that went back goes on from there"
    curve.add(1, 5.0)
    assert curve.points == [(1, 5.0)], "a group that went back to its start (restarted) starts its curve over"


def test_the_loss_band_keeps_each_bins_mean_least_and_greatest_in_bounded_bins():
    band = status_page.LossBand(limit=8)
    heard = [(step, scale / step) for step in range(1, 101) for scale in (1.0, 2.0, 6.0)]
    for step, loss in heard:
        band.add(step, loss)
    rows = band.rows()
    assert 4 <= len(rows) <= 8 and band.width == 16
    for first, mean, least, greatest in rows:
        mine = [loss for step, loss in heard if step // band.width == first // band.width]
        assert (mean, least, greatest) == pytest.approx((sum(mine) / len(mine), min(mine), max(mine)))


def _page_of(groups: int, eventful: int) -> str:
    """The page of ``groups`` groups at three steps, ``eventful`` of them lost and healed."""
    book, board = QuorumBook(FAST, started_at=0.0), status_page.StatusBoard()
    ids = [f"group-{i:03d}" for i in range(groups)]
    for step in (10, 20, 30):
        for i, g in enumerate(ids):
            book.heartbeat(g, 1.0, step=1)
            board.progress(g, GroupProgress(inner_step=step, train_loss=3.0 / step + i / 1000))
    board.membership(set(ids))
    for g in ids[:eventful]:
        board.event("lost", g)
        board.event("heal", g)
    snap = status_page.snapshot(JOB, SIG, book, {g: 1 for g in ids}, None, [], 1.0, board)
    return status_page.render_html(status_page.build_status(snap))


def test_past_sixteen_groups_the_page_draws_one_loss_band_and_rows_only_for_groups_with_news():
    """At 1,000 groups a line per group was most of the page's time and its legend ran off the
    drawing; a row per group made the timeline 22,000 pixels tall."""
    lines = _page_of(status_page.LINE_GROUPS, 0)
    assert lines.count("<polyline") == status_page.LINE_GROUPS and "<polygon" not in lines
    legend = [int(x) for x in re.findall(r'<text x="(\d+)" y="\d+" fill="#', lines)]
    assert len(legend) == status_page.LINE_GROUPS and max(legend) + 110 <= status_page.WIDTH, "the legend fits"

    band = _page_of(status_page.TICK_ROWS + 20, 2)
    assert band.count("<polyline") == 1 and band.count("<polygon") == 1 and "mean over 120 groups" in band
    timeline = band[band.index("<h2>timeline</h2>") :]
    assert ">group-000<" in timeline and ">group-001<" in timeline and ">group-002<" not in timeline
    assert "118 of 120 groups have no loss or heal here" in timeline
    assert timeline.count("<circle") == 6, "the two groups' joins, losses and heals; the others' joins: no row"


def _loss_ticks(svg: str) -> list[float]:
    """The tick values on a loss drawing's loss axis, bottom to top."""
    return [float(v) for v in re.findall(r'text-anchor="end">([\d.]+)</text>', svg)]


def test_the_loss_axis_holds_every_loss_and_clips_only_a_diverging_groups_saying_so():
    """A finished job's page topped its axis at 4.234 under a first loss of 5.19 (the 98th
    percentile was its top). The axis holds every loss drawn, names and ticks both axes, and
    clips only points far above the rest, a diverging group's, saying so."""
    falling = [(10 * i, 3.0 + 2.19 / i) for i in range(1, 101)]  # 5.19 at step 10, 3.02 at step 1,000
    svg = status_page.loss_svg({"A": falling}, [], {}, {"A": "#000"})
    ticks = _loss_ticks(svg)
    assert ticks[0] <= falling[-1][1] and ticks[-1] >= 5.19 and 3 <= len(ticks) <= 8, ticks
    assert ">train loss</text>" in svg and ">inner step</text>" in svg and ">1,000</text>" in svg
    assert "clipped" not in svg

    diverging = falling[:-2] + [(990, 40.0), (1000, 400.0)]
    both = status_page.loss_svg({"A": falling, "B": diverging}, [], {}, {"A": "#000", "B": "#111"})
    assert _loss_ticks(both) == ticks, "two points past 3x the 98th percentile do not flatten the rest"
    assert "clipped above 5.5: 2 points, up to 400</text>" in both
    tops = [float(y) for y in re.findall(r'<polyline [^>]*points="[^"]*?([\d.]+)"/>', both)]
    assert tops[1] == pytest.approx(8 + status_page.LEGEND_ROW), "B's last point drawn at the top edge"


def _evaluated_board(groups: int) -> status_page.StatusBoard:
    """``groups`` groups heard at steps 50 to 200, evaluating every 100 steps: each sign of life
    after an evaluation repeats it."""
    board = status_page.StatusBoard()
    for step in (50, 100, 150, 200):
        for i in range(groups):
            evaluated = {} if step < 100 else {"eval_loss": 4.0 - step // 100 + i / 2, "eval_step": 100 * (step // 100)}
            board.progress(f"g{i:02d}", GroupProgress(inner_step=step, train_loss=4.0 - step / 100, **evaluated))
    return board


def test_each_groups_eval_points_are_in_status_once_and_drawn_as_dots_with_a_key():
    book, board = QuorumBook(FAST, started_at=0.0), _evaluated_board(2)
    for g in ("g00", "g01"):
        book.heartbeat(g, 1.0, step=1)
    status = status_page.build_status(status_page.snapshot(JOB, SIG, book, {}, None, [], 1.0, board))
    assert status["eval_curves"] == {"g00": [(100, 3.0), (200, 2.0)], "g01": [(100, 3.5), (200, 2.5)]}
    assert {g["id"]: (g["eval_loss"], g["eval_step"]) for g in status["groups"]} == {
        "g00": (2.0, 200),
        "g01": (2.5, 200),
    }
    page = status_page.render_html(status)
    drawing = page[page.index("<h2>loss</h2>") : page.index("<h2>timeline</h2>")]
    assert drawing.count("<circle") == 4 and drawing.count("<polyline") == 2
    assert "lines: train loss; dots: eval loss</text>" in drawing and ">train and eval loss</text>" in drawing
    assert "<td>2.0000 (step 200)</td>" in page and "<th>tokens/s (last logged steps)</th>" in page

    many = status_page.LINE_GROUPS + 1
    board = _evaluated_board(many)
    snap = status_page.snapshot(JOB, SIG, QuorumBook(FAST, started_at=0.0), {}, None, [], 1.0, board)
    status = status_page.build_status(snap)
    band = status_page.loss_svg(status["curves"], status["loss_band"], status["eval_curves"], {})
    assert band.count("<circle") == 2, "past the line groups: one dot per eval step, the groups' mean"
    assert "black dots: the groups' mean eval loss</text>" in band


def test_recent_quorums_show_each_rounds_id_beside_the_quorum_id_that_holds_with_the_membership():
    """Every row of "recent quorums" read id 1: the quorum id stays while the membership does."""
    history = [
        {"quorum_id": 1, "round_id": r, "participants": ["A"], "max_step": r - 1, "heal_from": {}, "formed_at": 1.0}
        for r in (1, 2, 3)
    ]
    current = (Quorum(1, ("A",), max_step=2, heal_from={}, round_id=3), 1.0)
    book = QuorumBook(FAST, started_at=0.0)
    snap = status_page.snapshot(JOB, SIG, book, {}, current, history, 1.5, status_page.StatusBoard())
    page = status_page.render_html(status_page.build_status(snap))
    now, recent = page.split("<h2>recent quorums</h2>")
    assert recent.count("<th>round id</th><th>quorum (lane) id</th>") == 1 and "quorum (lane) id:" in recent
    assert re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td>", recent) == [("3", "1"), ("2", "1"), ("1", "1")]
    assert "<tr><td>3</td><td>1</td><td>A</td>" in now[now.index("<h2>current quorum</h2>") :]


def test_once_the_job_has_ended_no_group_is_shown_waiting_for_a_quorum():
    """A finished job's page showed its groups "waiting for quorum: True": their last asks, never answered."""
    book = QuorumBook(FAST, started_at=0.0)
    book.heartbeat("A", 1.0, step=4)
    asked = status_page.snapshot(JOB, SIG, book, {"A": 4}, None, [], 1.0, status_page.StatusBoard())
    asked = dataclasses.replace(asked, pending=frozenset({"A"}))
    assert [g["waiting_for_quorum"] for g in status_page.build_status(asked)["groups"]] == [True]
    ended = dataclasses.replace(asked, ended=JobEnd(round=4, digest="d4", holders=("A",)))
    assert [g["waiting_for_quorum"] for g in status_page.build_status(ended)["groups"]] == [False]


def test_history_keeps_the_last_quorums(start):
    lh = start(history=2)
    beat(lh, "A")
    for step in range(3):
        quorums(ask_all(lh, {"A": step}))
    assert [h["max_step"] for h in status(lh)["history"]] == [1, 2]


# -- restarts, the store, the client's limits ---------------------------------------------
def test_a_restarted_lighthouse_is_repopulated_by_heartbeats(start):
    lh = start()
    beat(lh, "AB")
    quorums(ask_all(lh, {"A": 1, "B": 1}))
    last = quorums(ask_all(lh, {"A": 2, "B": 2}, failed=("B",)))["A"].quorum_id
    port = lh.port
    lh.stop()
    with pytest.raises(LighthouseUnavailable):
        client(None, "A", url=f"http://127.0.0.1:{port}").heartbeat(2, last)
    again = start(port=port)
    assert again.port == port and status(again)["groups"] == []
    client(again, "A").heartbeat(2, last)
    client(again, "B").heartbeat(2, last - 1)
    assert [(g["id"], g["step"], g["healthy"]) for g in status(again)["groups"]] == [("A", 2, True), ("B", 2, True)]
    got = quorums(ask_all(again, {"A": 2, "B": 2}))
    assert got["A"] == got["B"] and got["A"].quorum_id > last


def test_a_quorum_request_alone_carries_the_last_id_to_a_restarted_lighthouse(start):
    lh = start()
    a = client(lh, "A")
    a.heartbeat(0, 41)
    first, _ = a.quorum(0, False, timeout_s=2.0)
    assert first.quorum_id == 42
    port = lh.port
    lh.stop()
    start(port=port)
    second, _ = a.quorum(0, False, timeout_s=2.0)  # no heartbeat to the new lighthouse first
    assert second.quorum_id == 43


def test_an_ask_or_a_commit_is_the_heartbeat_due_after_it_and_a_failed_request_is_none(start):
    """The lighthouse takes an ask or a commit (refused or not) as a heartbeat, so the
    client's next beat is due an interval after it; a lane watch, a refusal or a request that never
    arrived stands for nothing."""
    lh = start()
    hour = 3600.0
    a = client(lh, "A")
    assert a.beat_due_in(hour) <= 0, "nothing sent yet: a beat is due"
    round_id = a.quorum(0, False, timeout_s=3.0)[0].round_id
    assert a.beat_due_in(hour) > 0
    for commit in (lambda c: c.commit(round_id, step=1), lambda c: c.commit(round_id + 7, step=1)):
        c = client(lh, "A")
        commit(c)
        assert c.beat_due_in(hour) > 0
    watcher = client(lh, "A")
    watcher.lane_watch(round_id + 7, timeout_s=0.1)
    refused, unreachable = client(lh, "A", token="wrong"), client(None, "A", url="http://127.0.0.1:9")
    for failing in (refused, unreachable):
        assert isinstance(outcome(lambda: failing.heartbeat(0, 0)), (LighthouseRefused, LighthouseUnavailable))
    assert max(c.beat_due_in(hour) for c in (watcher, refused, unreachable)) <= 0


def test_the_heartbeat_thread_sends_no_beat_while_asks_and_commits_stand_for_them():
    class StandIn:  # when the thread beats is the subject, not the lighthouse
        url, connect_timeout_s = "http://stand-in", 1.0
        beats, signed = 0, True

        def heartbeat(self, *args: object, **kwargs: object) -> dict[str, str]:
            self.beats += 1
            return {}

        def beat_due_in(self, interval_s: float) -> float:
            return interval_s if self.signed else 0.0

    stand_in = StandIn()
    lanes = Lanes(local_rank=0, connect_timeout_s=1.0, collective_timeout_s=1.0)
    manager = Manager(  # type: ignore[arg-type]
        group="A", inner_pg=None, client=stand_in, lanes=lanes, quorum_timeout_s=1.0, heartbeat_interval_s=0.01
    )
    manager.start()
    time.sleep(0.3)  # thirty intervals, each with an ask or commit just sent
    assert stand_in.beats == 1, "the first contact's only"
    stand_in.signed = False
    wait_until(lambda: stand_in.beats >= 3)
    manager.stop()


def test_asks_and_commits_report_progress_as_the_heartbeats_they_stand_for_would(start):
    """Rounds faster than heartbeats (a sync warm-up's 10-step windows) leave no heartbeat due:
    the page showed a group's first figures for the whole run while it trained on."""
    lh = start()
    a = client(lh, "A")
    a.heartbeat(0, 0, progress=GroupProgress(inner_step=5, train_loss=3.0))
    round_id = a.quorum(0, False, 3.0, progress=GroupProgress(inner_step=10, train_loss=2.5))[0].round_id
    shown = status(lh)["groups"][0]
    assert (shown["inner_step"], shown["train_loss"]) == (10, 2.5), "the ask's progress"
    a.commit(round_id, step=1, progress=GroupProgress(inner_step=20, train_loss=2.0, digest="c" * 64))
    s = status(lh)
    assert {k: s["groups"][0][k] for k in ("step", "inner_step", "train_loss", "digest")} == {
        "step": 1,
        "inner_step": 20,
        "train_loss": 2.0,
        "digest": "c" * 64,
    }, "the commit's progress"
    assert s["curves"]["A"] == [[5, 3.0], [10, 2.5], [20, 2.0]]


def test_the_hosted_store_is_reachable(start):
    lh = start()
    beat(lh, "A")
    _, (host, port) = client(lh, "A").quorum(0, False, timeout_s=2.0)
    assert (host, port) == lh.store_address and port > 0
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
    store.set("lane/0", b"hello")
    assert store.get("lane/0") == b"hello"


def test_a_closed_port_is_unavailable_at_once():
    """A refused connection is reported as it happens: with every timeout at 600 s, far past the hang
    guard, the calls return at all only if nothing waits for one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = LighthouseClient(
        f"http://127.0.0.1:{port}", token=TOKEN, job_id=JOB, signature=SIG, group="A", connect_timeout_s=600.0
    )
    for call in (lambda: c.heartbeat(0, 0), lambda: c.quorum(0, False, timeout_s=600.0)):
        error = outcome(call)
        assert isinstance(error, LighthouseUnavailable) and "unreachable" in str(error), error
        assert "Connection refused" in str(error), error


def test_a_lighthouse_that_never_answers_times_out_within_the_limit():
    with socket.socket() as silent:  # accepts connections (backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        c = LighthouseClient(
            f"http://127.0.0.1:{silent.getsockname()[1]}",
            token=TOKEN,
            job_id=JOB,
            signature=SIG,
            group="A",
            connect_timeout_s=0.2,
        )
        # Nothing ever answers: the calls return at all (within the hang guard) only by their own limit.
        for call in (lambda: c.heartbeat(0, 0), lambda: c.quorum(0, False, timeout_s=0.2)):
            error = outcome(call)
            assert isinstance(error, LighthouseUnavailable) and "timed out" in str(error), error


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"cluster.lighthouse.port=70000"):
        LighthouseConfig(port=70000).validate()
    with pytest.raises(ConfigError, match=r"cluster.lighthouse.history=0"):
        LighthouseConfig(history=0).validate()
    with pytest.raises(ConfigError, match=r"cluster.lighthouse.store_port=29510: must differ"):
        LighthouseConfig(port=29510, store_port=29510).validate()
    with pytest.raises(ConfigError, match="cluster.min_groups"):
        Lighthouse(LighthouseConfig(port=0), QuorumRules(min_groups=0), JOB)


def test_a_busy_store_port_names_its_key_and_the_fix():
    """torch's EADDRINUSE text named the port only."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        lighthouse = Lighthouse(LighthouseConfig(port=0, store_port=port), QuorumRules(), JOB)
        with pytest.raises(OSError) as refused:
            lighthouse.start()
    assert str(refused.value) == (
        f"lighthouse cannot host its store on cluster.lighthouse.store_port={port} (address already in use); "
        "stop what listens there or pick another cluster.lighthouse.store_port (0 picks a free one)"
    )


def test_no_pickle_anywhere_in_diloco_ft():
    """docs/design.md, invariant 5: nothing received over the network is unpickled."""
    offenders = []
    for path in sorted((REPO / "diloco" / "ft").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.name}: import {n}" for n in names if n.split(".")[0] in {"pickle", "dill", "cloudpickle"}
            ]
        offenders += [f"{path.name}: {word}" for word in ("torch.load", "pickle.loads") if word in text]
    assert not offenders, offenders


@pytest.mark.slow
def test_serve_forever_prints_its_address_and_a_sigterm_before_the_end_is_no_clean_exit(tmp_path):
    """Exit 0 means the job ended (a supervisor or orchestrator then restarts nothing). Either way
    the lighthouse leaves its page behind as it stops."""
    page = tmp_path / "status.html"
    code = (
        "import pathlib; "
        "from diloco.config.cluster import LighthouseConfig; from diloco.ft.lighthouse import serve_forever; "
        "from diloco.ft.quorum import JobEnd, QuorumRules; "
        f"serve_forever(LighthouseConfig(port=0), QuorumRules(), 'solo', 'sig', saved_page=pathlib.Path({str(page)!r}))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://127.0.0.1:\d+);", line).group(1)
        with NO_PROXY.open(url + "/status", timeout=5.0) as r:
            assert json.loads(r.read())["job"] == "solo"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 1
        assert "lighthouse of job 'solo' stopped by a signal before the job ended" in proc.stderr.read()
        assert "<title>lighthouse: solo</title>" in page.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


class NeverDone:
    """A stand-in for a Gloo send or recv whose peer hangs: no future, and a wait that runs out."""

    def get_future(self) -> None:
        raise RuntimeError("Work::getFuture not implemented.")

    def wait(self, timeout: timedelta) -> None:
        threading.Event().wait(timeout.total_seconds())
        raise RuntimeError(f"Timed out waiting {timeout} for the hung peer")


@pytest.mark.slow  # a lighthouse and its groups' rounds (~1-2 s)
def test_a_member_that_stops_heartbeating_ends_the_survivors_wait_at_once_and_commits_nothing(start):
    """A hung member, the rule with stand-ins: the lighthouse drops a silent member, the
    survivors' lane watch cancels their pending collective (30 s of collective timeout left) and
    a transfer with it, not one with another member; the silent one may not commit the round
    once it is back."""
    clock = ManualClock()
    lh = start(clock=clock)
    beat(lh, "ABC")
    round_id = quorums(ask_all(lh, {"A": 0, "B": 0, "C": 0}))["A"].round_id
    assert client(lh, "A").commit(round_id, step=1) == "", "a whole round may commit"
    assert {g["id"]: g["step"] for g in status(lh)["groups"]} == {"A": 1, "B": 0, "C": 0}, "recorded at once"
    cancel, failed = LaneCancel(), {}
    watcher = LaneWatcher(client(lh, "A"), poll_s=30.0)
    watcher.start()
    watcher.follow(round_id, cancel)

    def survivor_waits(peer: str | None) -> None:
        try:
            wait_work(NeverDone(), timeout_s=30.0, cancel=CancelScope(cancel, peer))
        except LaneError as error:
            failed[peer] = str(error)

    waits = {peer: threading.Thread(target=survivor_waits, args=(peer,), daemon=True) for peer in (None, "C", "B")}
    for waiting in waits.values():
        waiting.start()
    clock.advance(FAST.heartbeat_timeout_s / 2)
    beat(lh, "AB")
    clock.advance(FAST.heartbeat_timeout_s / 2)  # C has been silent (SIGSTOPped) for a whole heartbeat timeout
    for peer in (None, "C"):
        waits[peer].join(timeout=5.0)  # a hang guard, far below the 30 s the waits had left
    watcher.stop()
    assert set(failed) == {None, "C"} and waits["B"].is_alive(), f"given up: {sorted(failed, key=str)}"
    assert f"group C left round {round_id}: no heartbeat" in failed[None]
    beat(lh, "C")  # C resumes: it stays gone from the round and may not commit it
    assert f"group C left round {round_id}" in client(lh, "C").commit(round_id, step=1)
    assert client(lh, "B").commit(round_id, step=1) == "", "a member whose all-reduce completed commits"


def counted_watcher(lh: Lighthouse, group: str) -> tuple[LaneWatcher, list]:
    """A started lane watcher of ``group`` and the list of the polls it has sent."""
    polls: list = []
    watching = client(lh, group)
    lane_watch = watching.lane_watch
    watching.lane_watch = lambda *a, **kw: polls.append(a) or lane_watch(*a, **kw)  # type: ignore[method-assign]
    watcher = LaneWatcher(watching, poll_s=30.0)
    watcher.start()
    return watcher, polls


def test_the_lane_watcher_polls_once_across_rounds_and_keeps_its_next_rounds_news_for_that_round(start):
    """One long poll serves every round while none breaks; news of a round granted but
    not yet followed (it broke as its grant reached the worker) goes to that round's cancel, not to
    the cancel of the round before."""
    lh = start(QuorumRules(min_groups=2, join_timeout_s=10.0, heartbeat_timeout_s=30.0))
    watcher, polls = counted_watcher(lh, "A")
    cancels = []
    for step in range(3):
        cancels.append(LaneCancel())
        watcher.follow(quorums(ask_all(lh, {"A": step, "B": step}))["A"].round_id, cancels[-1])
    granted = quorums(ask_all(lh, {"A": 3, "B": 3}))["A"].round_id
    client(lh, "B").recovery(wait_ms=0)  # B died in the round A was granted and does not follow yet
    wait_until(lambda: watcher._news.round_id == granted)
    assert len(polls) == 1 and not any(cancel.is_set() for cancel in cancels)
    late = LaneCancel()
    watcher.follow(granted, late)
    watcher.stop()
    assert late.is_set() and late.hits("B") and not late.hits("C") and "group B left round" in late.reason


@pytest.mark.slow  # a lighthouse restarted (~2 s)
def test_a_lane_watcher_that_follows_a_round_of_a_lighthouse_before_a_restart_gets_the_new_ones_news(start):
    """A restarted lighthouse numbers its rounds from 1 again: the watch follows the round this one
    granted the group, not the worker's round 57, and the news of a round granted but not yet
    followed costs at most a poll a second, not a busy loop."""
    lh = start(QuorumRules(min_groups=2, join_timeout_s=10.0, heartbeat_timeout_s=30.0))
    watcher, polls = counted_watcher(lh, "A")
    before = LaneCancel()
    watcher.follow(57, before)
    granted = quorums(ask_all(lh, {"A": 0, "B": 0}))["A"].round_id
    client(lh, "B").recovery(wait_ms=0)
    time.sleep(1.5)
    assert granted == 1 and len(polls) <= 3 and not before.is_set()
    after = LaneCancel()
    watcher.follow(granted, after)
    assert after.wait(2.0) and after.hits("B")
    watcher.stop()


def test_a_formed_quorum_is_one_readable_log_line():
    """Not a JSON dump: which formation, the round it commits, who takes part and who heals."""
    quorum = Quorum(3, ("group0", "group1"), max_step=11, heal_from={"group1": "group0"}, round_id=13)
    assert formed_line(quorum) == "quorum 13 for round 12: group0, group1 (lane 3; group1 heals from group0)"
    closing = dataclasses.replace(quorum, heal_from={}, closing=True)
    assert formed_line(closing).endswith("(lane 3; closing: the finished groups hand on the final state)")
