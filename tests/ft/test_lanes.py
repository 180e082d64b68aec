"""A lane's rendezvous that a hung member holds up is given up by the lane's cancel.

Stand-ins and one real Gloo rendezvous on a real TCPStore; every wait is bounded by a hang
guard far below the timeouts the code was given, so a regression fails instead of hanging.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from diloco.ft.lanes import CancelScope, LaneCancel, LaneError, Lanes, wait_work
from diloco.ft.rendezvous import abandonable
from tests.hang_guard import guarded

GUARD_S = 20.0  # a hang guard, far below the 600 s limits given to the code under test


def test_a_build_that_finishes_in_time_gives_its_value_and_its_error():
    assert abandonable(lambda: 7, lambda: False, GUARD_S, discard=print, name="t") == 7

    def broken() -> int:
        raise RuntimeError("no peer")

    with pytest.raises(RuntimeError, match="no peer"):
        abandonable(broken, lambda: False, GUARD_S, discard=print, name="t")


def test_a_given_up_build_returns_none_and_what_it_builds_later_is_discarded():
    release, asked, discarded = threading.Event(), threading.Event(), threading.Event()
    late: list[str] = []

    def hung() -> str:
        release.wait(GUARD_S)
        return "late lane"

    def give_up() -> bool:
        asked.set()  # asked at least once while the build hangs
        return True

    def discard(value: str) -> None:
        late.append(value)
        discarded.set()

    assert abandonable(hung, give_up, 600.0, discard=discard, name="t") is None
    assert asked.is_set() and late == []
    release.set()
    assert discarded.wait(GUARD_S) and late == ["late lane"], "the late result was not handed to discard"


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield ("127.0.0.1", master.port)


def test_a_rendezvous_held_up_by_a_hung_member_ends_at_the_cancel_and_the_next_lane_forms(store):
    """Rank 1 never comes (a member SIGSTOPped as the lane forms): with 600 s of connect timeout
    the lane watch's cancel alone ends the wait. The given-up rendezvous still holds its store
    client (a TCPStore client runs one operation at a time), yet the next lane forms at once."""
    lanes = Lanes(local_rank=0, connect_timeout_s=600.0, collective_timeout_s=600.0)
    followed: list[LaneCancel] = []

    def cancel_soon(cancel: LaneCancel) -> None:
        followed.append(cancel)
        threading.Timer(0.2, cancel.set, args=("group B left round 3: no heartbeat", frozenset({"B"}))).start()

    outcome: list = []

    def form() -> None:
        try:
            outcome.append(lanes.ensure(1, 0, 2, store, follow=cancel_soon))
        except LaneError as error:
            outcome.append(error)

    forming = threading.Thread(target=form, daemon=True)
    forming.start()
    forming.join(GUARD_S)
    assert not forming.is_alive(), "the rendezvous was not given up at the cancel"
    assert isinstance(outcome[0], LaneError) and "given up while forming: group B left round 3" in str(outcome[0])
    assert lanes.pg is None and followed == [lanes.cancel], "the lane's own cancel is followed before it waits"
    assert not lanes.cancel.failed, "given up on word of a member that left: not a failure of the lane"

    alone = guarded(lambda: lanes.ensure(2, 0, 1, store), GUARD_S)
    assert not isinstance(alone, Exception), alone
    tensor = torch.ones(3)
    alone.allreduce([tensor]).wait()
    assert tensor.tolist() == [1.0, 1.0, 1.0]
    lanes.drop()


@pytest.mark.slow  # a Gloo lane waits out its timeout (~1 s)
def test_a_lane_that_times_out_is_marked_failed_and_one_given_up_on_a_cancel_is_not(store):
    """What the lighthouse's sit-out rule hears (``QuorumRequest.lane_failed``): a rendezvous or a
    collective that timed out or lost a peer, not one ended because a member left."""
    lanes = Lanes(local_rank=0, connect_timeout_s=0.5, collective_timeout_s=0.5)
    error = guarded(lambda: lanes.ensure(1, 0, 2, store), GUARD_S)  # rank 1 never comes
    assert isinstance(error, LaneError) and "could not form" in str(error), error
    assert lanes.cancel.failed

    class Unfinished:  # a send or a recv: no future, and its wait fails at its timeout
        def get_future(self) -> None:
            raise RuntimeError("Work::getFuture not implemented")

        def wait(self, timeout: timedelta) -> None:
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Timed out waiting 300ms for recv operation to complete")

    timed_out = LaneCancel()
    with pytest.raises(LaneError, match="lane collective failed"):
        wait_work(Unfinished(), 0.3, CancelScope(timed_out))
    assert timed_out.failed
    left = LaneCancel()
    left.set("group B left round 3", frozenset({"B"}))
    with pytest.raises(LaneError, match="lane given up"):
        wait_work(Unfinished(), 0.3, CancelScope(left))
    assert not left.failed
