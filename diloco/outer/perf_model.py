"""A performance model of a sync plan: the wall time of a window of inner steps, the compute
utilization it leaves, and the bandwidth a plan needs to reach a utilization.

Pure functions of plain numbers, so they can be checked on recorded measurements and fed
with published ones (``experiments/parallelism/simulate_scale.py``). Seconds, bytes and bits per second.
The same for a failure: how long a dead group's replacement takes to commit again, and the
compute the job loses meanwhile (``death_to_commit_seconds``, ``lost_group_seconds``); and for
groups of different speed, what time-bounded windows gain (``time_window_speedup``).

The model: each of the M groups computes an inner step in ``step_s``; a sync all-reduces
the payload over a ring of the M groups (each sends and receives 2(M−1)/M of it, in 2(M−1)
latency-bound hops); a fragment's all-reduce hides behind the ``overlap_steps`` inner steps
that follow its launch (Streaming DiLoCo's τ) and behind ``overlap_backward`` of a step (a
data-parallel gradient all-reduce overlapping the backward pass); whatever is not hidden
stalls every group. A gathered payload (quantized or sparse: Gloo cannot sum packed bytes)
goes to each of the M−1 peers instead (``SyncPlan.gathered``); ``topk_bits_per_param`` is the
size of ``algo.compress=topk``'s payload per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.outer.sparse import TopK
from diloco.schedule import WindowProblem, window_problem


@dataclass(frozen=True)
class Link:
    """The link between groups: bandwidth in bits per second, one-way latency per hop in seconds."""

    bandwidth_bps: float
    latency_s: float = 0.0


@dataclass(frozen=True)
class SyncPlan:
    """How groups synchronize: every ``sync_every`` inner steps (1: data parallel), in
    ``fragments`` pieces each overlapped with ``overlap_steps`` inner steps, at ``bits_per_param``
    on the wire."""

    sync_every: int = 1
    fragments: int = 1
    overlap_steps: int = 0
    bits_per_param: float = 32.0
    overlap_backward: float = 0.0  # fraction of a step the all-reduce hides behind (the backward pass)
    gathered: bool = False  # the payload is all-gathered (each group sends M−1 copies), not ring-reduced

    def __post_init__(self) -> None:
        problem = window_problem(self.sync_every, self.fragments, self.overlap_steps)
        if problem in (WindowProblem.H_BELOW_ONE, WindowProblem.P_BELOW_ONE, WindowProblem.P_NOT_DIVIDING_H):
            raise ValueError(f"need fragments dividing sync_every, got H={self.sync_every}, P={self.fragments}")
        if problem is not None or not 0 <= self.overlap_backward <= 1:
            raise ValueError(f"need 0 <= overlap_steps < H/P and 0 <= overlap_backward <= 1: {self}")


def ring_factor(groups: int) -> float:
    """The share of the payload each group sends (and receives) in a ring all-reduce: 2(M−1)/M."""
    return 2 * (groups - 1) / groups


def allreduce_seconds(payload_bytes: float, groups: int, link: Link) -> float:
    """One ring all-reduce of ``payload_bytes`` over ``groups`` groups (0 for a single group)."""
    if groups <= 1:
        return 0.0
    return ring_factor(groups) * payload_bytes * 8 / link.bandwidth_bps + 2 * (groups - 1) * link.latency_s


def gather_seconds(payload_bytes: float, groups: int, link: Link) -> float:
    """One all-gather of every group's ``payload_bytes``: each group sends its payload to the M−1 others."""
    if groups <= 1:
        return 0.0
    return (groups - 1) * payload_bytes * 8 / link.bandwidth_bps + (groups - 1) * link.latency_s


def topk_bits_per_param(codec: TopK, params: int) -> float:
    """Bits on the wire per parameter of a topk payload of ``params`` values (indices, values, scales)."""
    return 8 * codec.nbytes(params) / params


def fragment_bytes(plan: SyncPlan, params: float) -> float:
    return params * plan.bits_per_param / 8 / plan.fragments


def hidden_seconds(plan: SyncPlan, step_s: float) -> float:
    """How long a fragment's all-reduce may take without stalling anyone."""
    return (plan.overlap_steps + plan.overlap_backward) * step_s


def window_seconds(plan: SyncPlan, params: float, step_s: float, groups: int, link: Link) -> float:
    """Wall time of one window of H inner steps: their compute, plus each fragment's unhidden transfer."""
    transfer = gather_seconds if plan.gathered else allreduce_seconds
    stall = max(0.0, transfer(fragment_bytes(plan, params), groups, link) - hidden_seconds(plan, step_s))
    return plan.sync_every * step_s + plan.fragments * stall


def utilization(plan: SyncPlan, params: float, step_s: float, groups: int, link: Link) -> float:
    """Compute utilization: the share of wall time spent on inner steps."""
    return plan.sync_every * step_s / window_seconds(plan, params, step_s, groups, link)


def bandwidth_for(
    target: float, plan: SyncPlan, params: float, step_s: float, groups: int, latency_s: float = 0.0
) -> float:
    """The least bandwidth (bits/s) at which ``plan`` reaches compute utilization ``target``
    (inf when latency alone keeps it below; 0 with one group)."""
    if not 0 < target <= 1:
        raise ValueError(f"target utilization must be in (0, 1], got {target}")
    if groups <= 1:
        return 0.0
    # window <= H·step/target  <=>  each fragment's transfer <= hidden + H·step·(1/target − 1)/P
    budget = hidden_seconds(plan, step_s) + plan.sync_every * step_s * (1 / target - 1) / plan.fragments
    hops, share = (groups - 1, groups - 1) if plan.gathered else (2 * (groups - 1), ring_factor(groups))
    budget -= hops * latency_s
    if budget <= 0:
        return math.inf
    return share * fragment_bytes(plan, params) * 8 / budget


def time_window_speedup(step_s: list[float]) -> float:
    """Job throughput of time-bounded windows over step-bounded ones, for groups with these
    inner step times (sync time left out): with fixed H every group waits for the slowest, so
    the job trains M steps per slowest step; with time-bounded windows each group trains at
    its own pace, Σ 1/step_i."""
    if not step_s or min(step_s) <= 0:
        raise ValueError(f"need positive step times, got {step_s}")
    return sum(1 / s for s in step_s) / (len(step_s) / max(step_s))


# Recovery. A group dies at a uniformly random moment of the survivors' window W (seconds
# between their rounds). Its replacement (a warm spare taking over, or fresh workers after
# the backoff) is ready, asking for a quorum, ``ready_s`` after the death. The lighthouse
# lets a round wait up to ``join_s`` for a group it still counts healthy, which a replaced
# group is until its heartbeat times out, so a replacement joins the first round that
# started no earlier than ``join_s`` before it was ready, heals in it and commits it.


def wait_for_round_seconds(window_s: float, join_s: float) -> float:
    """Expected wait from a random moment to the round a group ready then joins: (W − j)²/2W.

    The next round starts u later, u uniform in [0, W); the one before started W − u ago
    and still waits for the group if W − u ≤ j.
    """
    if window_s <= 0 or join_s >= window_s:
        return 0.0
    return (window_s - join_s) ** 2 / (2 * window_s)


def death_to_commit_seconds(ready_s: float, window_s: float, join_s: float, round_s: float = 0.0) -> float:
    """Expected seconds from a group's death to its replacement's first committed round."""
    return ready_s + wait_for_round_seconds(window_s, join_s) + round_s


def lost_group_seconds(ready_s: float, window_s: float, join_s: float) -> float:
    """Expected compute a death costs the job, in seconds of one group's training: the dead
    group's work since its last round (half a window on average), then its absence until the
    replacement's first round. (On a shared machine the survivors take up part of it.)"""
    return window_s / 2 + ready_s + wait_for_round_seconds(window_s, join_s)


# The recovery choice. A dead group's replacement, ready at ``ready``, joins the survivors at
# one of their rounds (they come every W, the next one u after the death, u uniform in
# [0, W)). Waiting for it: the survivors' next round is held until it is ready (they stall
# max(0, ready − u)) and it joins that round (idle max(0, u − ready)). Going on without it:
# nobody stalls, and it joins the first round after it is ready (idle W/2 on average, for any
# ready). Both lose the dead group's compute until it is ready.


def expected_stall_seconds(ready_s: float, window_s: float) -> float:
    """E[max(0, ready − u)], u uniform in [0, W): how long a held round waits for the replacement."""
    if window_s <= 0:
        return ready_s
    if ready_s <= window_s:
        return ready_s**2 / (2 * window_s)
    return ready_s - window_s / 2


def recovery_costs(ready_s: float, window_s: float, survivors: int) -> dict[str, float]:
    """Expected group-seconds of training each option costs after a death (``ready_s``: until the
    replacement asks for a quorum; ``window_s``: the survivors' seconds between rounds)."""
    return {
        "wait": ready_s
        + wait_for_round_seconds(window_s, ready_s)
        + survivors * expected_stall_seconds(ready_s, window_s),
        "go_on": ready_s + window_s / 2,
    }


def choose_recovery(ready_s: float, window_s: float, survivors: int) -> str:
    """``wait`` for the replacement when that costs less than going on without it (ties wait:
    the survivors' rounds keep every group); waiting wins while ready < 2W / (1 + survivors)."""
    costs = recovery_costs(ready_s, window_s, survivors)
    return "wait" if costs["wait"] <= costs["go_on"] else "go_on"
