"""What every synchronizer shares: rounds through the manager, healing, commit records, digests.

``OuterSync`` (DiLoCo, Streaming DiLoCo) and ``GradientSync`` (the data-parallel baseline)
differ only in what they all-reduce and when; the trainer talks to either through the
hooks defined here.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diloco.byte_view import as_bytes_tensor, byte_view
from diloco.ft.manager import Manager, Round
from diloco.ft.state import HealState

log = logging.getLogger(__name__)


@dataclass
class OuterOutcome:
    """What the trainer learns from a synchronizer hook."""

    metrics: dict[str, float] = field(default_factory=dict)
    healed_to_step: int | None = None  # set when this group took a peer's state: jump to its step
    skip_step: bool = False  # the optimizer must not step (the gradient round failed)


class Synchronizer:
    """Bookkeeping and healing shared by the synchronizers; subclasses add the all-reduce."""

    def __init__(
        self,
        *,
        manager: Manager,
        heal_state: HealState,
        collective_timeout_s: float,
        commit_log: Callable[[dict], None],
    ) -> None:
        self.manager = manager
        self.heal_state = heal_state
        self.collective_timeout_s = collective_timeout_s
        self.commit_log = commit_log
        self.attempted = 0
        self.committed_here = 0
        self.bytes_sent = 0
        self.tokens = 0
        self.recoveries = 0
        self._fail_next_round = False

    def fail_next_round(self) -> None:
        """Fault injection: treat this worker's next all-reduce as failed after it completes.

        The peers commit, this group does not, and it heals at the next quorum; safe to call
        from a signal handler (it only sets a flag).
        """
        self._fail_next_round = True

    def join(self) -> OuterOutcome:
        """A starting group's first round: take the live state from a peer if the job is ahead."""
        return OuterOutcome()

    def before_optimizer_step(self, step: int) -> OuterOutcome:
        """Between backward and the inner optimizer step of inner step ``step``."""
        return OuterOutcome()

    def after_inner_step(self, step: int, tokens: int) -> OuterOutcome:
        """After inner step ``step`` consumed ``tokens``."""
        return OuterOutcome()

    def load_global_into_local(self) -> None:
        """Make the model hold the job's result (θ_g for DiLoCo) before the final eval and save."""

    def _after_heal(self) -> None:
        """Called once a peer's state has been applied."""

    def _take_injected_failure(self) -> bool:
        taken, self._fail_next_round = self._fail_next_round, False
        if taken:
            log.warning("group %s: injected failure of this round", self.manager.group)
        return taken

    def _heal_and_serve(self, round_: Round, step: int) -> tuple[bool, int | None]:
        """Serve groups healing from us; receive a peer's state if we are behind.

        Returns (ok, the inner step we jumped to if we healed). The received state is
        staged and applied only if every rank of the group got its part, so a failed
        transfer leaves the live state untouched; the group heals again next quorum. A
        failed transfer may leave messages queued on the lane, so the lane is dropped and
        this round is given up (the next quorum gets a new id and fresh lanes).
        """
        sent = all(
            self.heal_state.send(round_.lane, t, self.manager.committed, step, self.collective_timeout_s)
            for t in round_.heal_targets
        )
        source = round_.heal_source
        staged = None
        if source is not None:
            staged = self.heal_state.receive(round_.lane, source, self.collective_timeout_s)
        transfers_ok = self.manager.all_ranks(sent and (source is None or staged is not None))
        if not transfers_ok:
            self.manager.lanes.drop()
            return False, None
        if staged is None:
            return True, None
        self.manager.committed, healed_step = self.heal_state.apply(staged)
        self._after_heal()
        self.recoveries += 1
        log.info("group %s healed: round %d, inner step %d", self.manager.group, self.manager.committed, healed_step)
        return True, healed_step

    def _record(self, round_: Round, committed: bool, step: int) -> dict[str, float]:
        """Log the round (with the group's digest when committed) and return its metrics."""
        self.committed_here += int(committed)
        self.commit_log(
            {
                "round": self.manager.committed,
                "committed": committed,
                "quorum_id": round_.quorum.quorum_id,
                "participants": list(round_.quorum.participants),
                "inner_step": step,
                "recoveries": self.recoveries,
                "digest": self.group_digest() if committed else None,
            }
        )
        return {
            "outer/committed": float(committed),
            "outer/participants": float(round_.size),
            "outer/round": float(self.manager.committed),
            "outer/syncs_committed": float(self.committed_here),
            "outer/syncs_attempted": float(self.attempted),
            "outer/bytes": float(self.bytes_sent),
            "outer/bytes_per_token": self.bytes_sent / self.tokens if self.tokens else 0.0,
            "outer/recoveries": float(self.recoveries),
        }

    def report(self) -> dict[str, Any]:
        """The group's outer counters and final digest for summary.json (a collective)."""
        return {
            "rounds": self.manager.committed,
            "syncs_committed": self.committed_here,
            "syncs_attempted": self.attempted,
            "bytes_sent": self.bytes_sent,
            "recoveries": self.recoveries,
            "digest": self.group_digest(),
        }

    def group_digest(self) -> str:
        """sha256 over every rank's θ_g and outer-optimizer state (a collective over the group)."""
        own = hashlib.sha256()
        for name, tensor in self.heal_state.global_tensors().items():
            raw = as_bytes_tensor(tensor)
            own.update(name.encode())
            own.update(byte_view(raw))
        return self.manager.combine_digests(own.digest())
