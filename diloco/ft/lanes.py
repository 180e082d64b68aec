"""Outer lanes: worker r of every participating group in one Gloo process group.

A lane is built for one quorum id under its own store prefix and thrown away (aborted) when
the quorum changes, so a dead or stale member can never wedge the next round. Gloo cannot
interrupt an operation in flight (neither ``abort`` nor ``shutdown`` wakes a wait on a hung
peer, and destroying the group blocks until the operation times out), so a wait on a lane
ends either when its work completes or when the lane's ``LaneCancel`` is set (the lane was
dropped, or the lighthouse said the round lost a member), and a dropped lane is kept alive
until whatever it had in flight has timed out. A lane's rendezvous is waited on the same
way: it runs on a helper thread (``rendezvous.abandonable``) that a cancel walks away from.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from diloco.ft.rendezvous import abandonable

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a wait on a lane looks at its cancel (completion wakes it at once)
RETIRE_MARGIN_S = 5.0  # a dropped lane outlives its collective timeout by this much before it is destroyed


class LaneError(RuntimeError):
    """A lane could not be built or a lane collective failed; the round is not committed."""


class LaneCancel:
    """Which waits on a lane must end now: all of them (the lane was dropped, or this group
    left its round), or those that involve a member that left the round: every collective, and
    a transfer with that member (a heal between two others goes on)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._everything = False
        self._gone: frozenset[str] = frozenset()
        self.reason = ""
        # The lane itself failed (a rendezvous or collective timed out or lost a peer), as opposed
        # to being given up on word of a member that left: what the lighthouse's sit-out rule counts.
        self.failed = False

    def set(self, reason: str, gone: frozenset[str] | None = None) -> None:
        """End every wait (``gone`` None) or those involving the groups in ``gone``."""
        with self._lock:
            self.reason = self.reason or reason
            if gone is None:
                self._everything = True
            else:
                self._gone |= gone
        self._changed.set()

    def is_set(self) -> bool:
        return self._changed.is_set()

    def hits(self, peer: str | None) -> bool:
        """Whether a wait on a collective (``peer`` None) or on a transfer with ``peer`` must end."""
        with self._lock:
            return self._everything or (bool(self._gone) and (peer is None or peer in self._gone))

    def wait(self, timeout_s: float) -> bool:
        return self._changed.wait(timeout_s)


@dataclass(frozen=True)
class CancelScope:
    """A ``LaneCancel`` as one operation sees it: a collective (``peer`` None) or a transfer with ``peer``."""

    cancel: LaneCancel
    peer: str | None = None

    def hit(self) -> bool:
        return self.cancel.hits(self.peer)

    @property
    def reason(self) -> str:
        return self.cancel.reason


def wait_work(work: dist.Work, timeout_s: float, cancel: CancelScope | None = None) -> None:
    """Wait for a lane operation with a bound; a lost peer, broken lane, timeout or cancel becomes a ``LaneError``.

    With a ``cancel``, the wait ends as soon as it hits this operation. Gloo's collectives say when they are
    done through a future; its send and recv have none (and report themselves completed only
    once waited on; a wait that times out closes the connection), so a helper thread waits
    for them, and is left behind, bounded by ``timeout_s``, if the wait is cancelled.
    """
    if cancel is None:
        _wait(work, timeout_s)
        return
    done, failure = threading.Event(), []
    try:
        work.get_future().add_done_callback(lambda _: done.set())
        waited_in_thread = False
    except RuntimeError:  # "Work::getFuture not implemented": a send or a recv

        def wait_in_thread() -> None:
            try:
                _wait(work, timeout_s)
            except LaneError as error:
                failure.append(error)
            done.set()

        threading.Thread(target=wait_in_thread, name="lane-wait", daemon=True).start()
        waited_in_thread = True
    deadline = time.monotonic() + timeout_s
    while not done.wait(POLL_S):
        if cancel.hit():
            raise LaneError(f"lane given up: {cancel.reason}")
        if not waited_in_thread and time.monotonic() >= deadline:
            break
    try:
        if failure:
            raise failure[0]
        if not waited_in_thread:
            _wait(work, max(deadline - time.monotonic(), 0.001))
    except LaneError:
        cancel.cancel.failed = True
        raise


def _wait(work: dist.Work, timeout_s: float) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as error:  # how Gloo reports a lost peer, a broken lane or a timeout
        raise LaneError(f"lane collective failed: {error}") from error


class Lanes:
    """This worker's lane, rebuilt on a new store prefix whenever the quorum id changes."""

    def __init__(self, *, local_rank: int, connect_timeout_s: float, collective_timeout_s: float) -> None:
        self.local_rank = local_rank
        self.connect_timeout_s = connect_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.pg: dist.ProcessGroup | None = None
        self.quorum_id: int | None = None
        self.cancel = LaneCancel()  # of the current lane
        self._retired: list[tuple[float, dist.ProcessGroup]] = []  # (destroy after, dropped lane)
        self._store: dist.Store | None = None
        self._store_address: tuple[str, int] | None = None

    def ensure(
        self,
        quorum_id: int,
        rank: int,
        size: int,
        store_address: tuple[str, int],
        follow: Callable[[LaneCancel], None] | None = None,
    ) -> dist.ProcessGroup:
        """The lane for ``quorum_id``: reused while the quorum holds, rebuilt when it changes.

        ``follow`` gets the lane's cancel before anything waits, so whoever watches the round
        ends a rendezvous that a hung member holds up as it ends the lane's collectives.
        """
        if (
            self.pg is not None
            and self.quorum_id == quorum_id
            and self._store_address == store_address
            and not self.cancel.is_set()
        ):
            if follow is not None:
                follow(self.cancel)
            return self.pg
        self.drop()
        self.cancel = LaneCancel()
        if follow is not None:
            follow(self.cancel)
        try:
            self.pg = self._rendezvous(quorum_id, rank, size, self._connect_store(store_address))
        except LaneError:
            self.cancel.failed = not self.cancel.is_set()  # given up on a member that left: no failure of its own
            raise
        self.quorum_id = quorum_id
        return self.pg

    def _rendezvous(self, quorum_id: int, rank: int, size: int, store: dist.Store) -> dist.ProcessGroup:
        """Gloo's rendezvous on a helper thread, given up when the lane's cancel hits a collective.

        Bounded by the rendezvous's own limits (the store's connect timeout, then the
        collective timeout for the connections). A rendezvous given up keeps the store
        client it waits on (a TCPStore client runs one operation at a time), so the next
        lane connects a fresh one; a group it still forms is aborted, never used.
        """
        prefix = f"diloco/quorum{quorum_id}/lane{self.local_rank}"
        collective = timedelta(seconds=self.collective_timeout_s)
        try:
            pg = abandonable(
                lambda: dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, collective),
                CancelScope(self.cancel).hit,
                self.connect_timeout_s + self.collective_timeout_s,
                _abort_unused,
                f"lane{self.local_rank}-rendezvous",
            )
        except RuntimeError as error:  # Gloo's rendezvous failures (DistStoreError and others) are RuntimeErrors
            raise LaneError(f"lane {self.local_rank} of quorum {quorum_id} could not form: {error}") from error
        if pg is None:
            self._store, self._store_address = None, None
            why = self.cancel.reason or "its rendezvous outlived the connect and collective timeouts"
            raise LaneError(f"lane {self.local_rank} of quorum {quorum_id} given up while forming: {why}")
        return pg

    def drop(self) -> None:
        """Abort the current lane and forget it: waits on it end at once (``cancel``), and
        it is destroyed only once what it had in flight has timed out (see the module docstring)."""
        self.cancel.set("the lane was dropped")
        now = time.monotonic()
        self._retired = [(until, pg) for until, pg in self._retired if until > now]
        if self.pg is not None:
            try:
                self.pg.abort()
            except RuntimeError as error:  # an already broken lane may refuse even this
                log.debug("aborting lane of quorum %s: %s", self.quorum_id, error)
            self._retired.append((now + self.collective_timeout_s + RETIRE_MARGIN_S, self.pg))
        self.pg = None
        self.quorum_id = None

    def _connect_store(self, address: tuple[str, int]) -> dist.Store:
        if self._store is None or self._store_address != address:
            try:
                self._store = dist.TCPStore(
                    address[0],
                    address[1],
                    is_master=False,
                    timeout=timedelta(seconds=self.connect_timeout_s),
                )
            except RuntimeError as error:  # DistStoreError, DistNetworkError
                raise LaneError(f"lighthouse store {address[0]}:{address[1]} unreachable: {error}") from error
            self._store_address = address
        return self._store


def _abort_unused(pg: dist.ProcessGroup) -> None:
    """A lane whose rendezvous was given up but completed after all: nobody will use it."""
    try:
        pg.abort()
    except RuntimeError as error:
        log.debug("aborting a lane formed after it was given up: %s", error)
