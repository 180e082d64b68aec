"""Where an outer round's time goes: milliseconds per phase, so a slow round is read off its metrics.

A round's phases, in the order it runs them (docs/algorithm.md, "An outer round's phases"):

    delta       Δ = θ_g − θ_l snapshotted into the fragment's staging buffer
    quorum      the lighthouse's answer (``Manager.start_round``)
    finite      the group's non-finite check (a collective over the group's ranks)
    encode      w·Δ in the payload codec
    wire        waiting for the lane's collective: what the link and the other groups cost
    decode      the summed payload back to Δ̄
    heal        state sent to or received from a peer (a round that heals)
    commit      the lighthouse's commit round trip and the group's agreement on it
    outer_step  θ_g ← OuterOpt(θ_g, Δ̄) and θ_l's update
    digest      the sha256 of the state the commit changed

With τ > 0 the first six run on the round's background thread, beside the inner steps; a
round's ``outer/sync_ms`` is only what the training thread waited, so their sum can exceed it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseClock:
    """Milliseconds spent per phase of one round, summed over the phase's visits."""

    def __init__(self, ms: dict[str, float] | None = None) -> None:
        self.ms: dict[str, float] = dict(ms or {})

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.ms[phase] = self.ms.get(phase, 0.0) + 1000 * (time.perf_counter() - started)

    def copy(self) -> PhaseClock:
        return PhaseClock(self.ms)

    def metrics(self) -> dict[str, float]:
        """``outer/<phase>_ms`` for every phase the round ran."""
        return {f"outer/{phase}_ms": ms for phase, ms in self.ms.items()}
