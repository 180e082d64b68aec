"""Outer lanes: worker r of every participating group in one Gloo process group.

A lane is built for one quorum id under its own store prefix and thrown away (aborted) when
the quorum changes, so a dead or stale member can never wedge the next round.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)


class LaneError(RuntimeError):
    """A lane could not be built or a lane collective failed; the round is not committed."""


class Lanes:
    """This worker's lane, rebuilt on a new store prefix whenever the quorum id changes."""

    def __init__(self, *, local_rank: int, connect_timeout_s: float, collective_timeout_s: float) -> None:
        self.local_rank = local_rank
        self.connect_timeout_s = connect_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.pg: dist.ProcessGroup | None = None
        self.quorum_id: int | None = None
        self._store: dist.Store | None = None
        self._store_address: tuple[str, int] | None = None

    def ensure(self, quorum_id: int, rank: int, size: int, store_address: tuple[str, int]) -> dist.ProcessGroup:
        """The lane for ``quorum_id``: reused while the quorum holds, rebuilt when it changes."""
        if self.pg is not None and self.quorum_id == quorum_id and self._store_address == store_address:
            return self.pg
        self.drop()
        store = self._connect_store(store_address)
        prefix = f"diloco/quorum{quorum_id}/lane{self.local_rank}"
        try:
            self.pg = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=self.collective_timeout_s)
            )
        except RuntimeError as error:  # Gloo's rendezvous failures (DistStoreError and others) are RuntimeErrors
            raise LaneError(f"lane {self.local_rank} of quorum {quorum_id} could not form: {error}") from error
        self.quorum_id = quorum_id
        return self.pg

    def drop(self) -> None:
        """Abort the current lane (pending collectives fail at once) and forget it."""
        if self.pg is not None:
            try:
                self.pg.abort()
            except RuntimeError as error:  # an already broken lane may refuse even this
                log.debug("aborting lane of quorum %s: %s", self.quorum_id, error)
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
