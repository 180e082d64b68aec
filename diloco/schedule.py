"""The outer schedule, as pure functions of plain numbers: config validation, the synchronizer
and the performance model all read it here.

DiLoCo (arXiv 2311.08105) syncs every H inner steps; Streaming DiLoCo (arXiv 2501.18512) syncs
P fragments in turn, H/P steps apart, each launched τ steps before it is applied, so P divides
H and τ < H/P (``window_problem``). A sync warm-up (post-local SGD, arXiv 1808.07217) runs
windows of H₀ < H steps up to inner step W (``sync_warmup_window``). A job whose last step T
falls inside a window ends with a shorter one, synced at T (``last_window``). The mixing α(s, M)
and the outer momentum μ(s) ramp in over the first inner steps (``mixing_alpha``, ``momentum``).

Steps count completed inner steps: ``step = s`` means "after inner step s", s ≥ 1.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class WindowProblem(Enum):
    """The first rule of a window that (H, P, τ) breaks."""

    H_BELOW_ONE = "H >= 1"
    P_BELOW_ONE = "P >= 1"
    P_NOT_DIVIDING_H = "P divides H"
    TAU_NEGATIVE = "τ >= 0"
    TAU_NOT_BELOW_SPACING = "τ < H/P"


def window_problem(H: int, P: int, tau: int) -> WindowProblem | None:
    """Why windows of H steps cannot sync P fragments with overlap τ; None when they can."""
    if H < 1:
        return WindowProblem.H_BELOW_ONE
    if P < 1:
        return WindowProblem.P_BELOW_ONE
    if H % P != 0:
        return WindowProblem.P_NOT_DIVIDING_H
    if tau < 0:
        return WindowProblem.TAU_NEGATIVE
    if tau >= H // P:
        return WindowProblem.TAU_NOT_BELOW_SPACING
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def whole_windows(steps: int, H: int) -> int:
    """``steps`` rounded up to a multiple of H."""
    return -(-steps // H) * H


class SyncWarmup(NamedTuple):
    """Windows of ``every`` (H₀) inner steps for the applies up to inner step ``steps`` (W), then H.

    W is a multiple of H and H₀ divides H, so the last warm-up window ends where an H window
    would: the windows after it, checkpoints and the job's last round fall where they would
    without the warm-up.
    """

    every: int
    steps: int

    def window(self, apply_step: int, H: int) -> int:
        return self.every if apply_step <= self.steps else H


def sync_warmup_window(H: int, P: int, tau: int, every: int, steps: int) -> SyncWarmup | None:
    """(H₀, W): H₀ the shortest divisor of H from ``every`` up whose windows sync P fragments
    with overlap τ, W ``steps`` in whole H windows; None when ``steps`` is 0 or no H₀ < H fits."""
    if steps == 0:
        return None
    fits = [h for h in divisors(H) if every <= h < H and window_problem(h, P, tau) is None]
    return SyncWarmup(fits[0], whole_windows(steps, H)) if fits else None


class LastWindow(NamedTuple):
    """The job's last window (E, T], shorter than the windows before it: T, the job's last step, is
    no window end, E the last one before it. One round at T syncs every fragment, so every inner
    step reaches θ_g; it launches τ_T = min(τ, T − E − 1) steps before T, after the round applied
    at E; no other round falls in the window.
    """

    start: int
    end: int

    def launch_step(self, tau: int) -> int:
        return self.end - min(tau, self.end - self.start - 1)


def last_window(end: int, H: int, warmup: SyncWarmup | None = None) -> LastWindow | None:
    """The shorter last window of a job of ``end`` inner steps; None when ``end`` ends a window (or is 0: no end)."""
    if end < 1:
        return None
    start = end - end % (H if warmup is None else warmup.window(end, H))
    return LastWindow(start, end) if start < end else None


def ramp(s: int, steps: int) -> float:
    """min(1, s/steps), from s = 1: a join round at step 0 ramps like step 1."""
    return min(1.0, max(s, 1) / steps)


def mixing_alpha(s: int, M: int, alpha: float, warmup_steps: int, reference_groups: int) -> float:
    """α(s, M) = α·min(1, (N/M)²)·ramp(s) for a round of M groups launched after inner step s.

    N = ``reference_groups`` (0: no groups' factor); the ramp over ``warmup_steps`` (0: none).
    """
    if reference_groups:
        alpha *= min(1.0, (reference_groups / M) ** 2)
    if warmup_steps:
        alpha *= ramp(s, warmup_steps)
    return alpha


def momentum(s: int, mu: float, warmup_steps: int) -> float:
    """μ(s) = μ·ramp(s) over ``warmup_steps`` ≥ 1, for a round launched after inner step s.

    Trained from scratch, the first windows' Δ are the largest of the run and point the same way:
    with μ = 0.9 from the first round, Nesterov applies each about 1/(1 − μ) = 10 times over the
    next windows and overshoots (docs/algorithm.md). s is the round's launch step, which every
    group of the round shares, so all groups take the same outer step.
    """
    return mu * ramp(s, warmup_steps)


def fragment_offset(p: int, H: int, P: int) -> int:
    """Where in the H-step window fragment p is applied: after inner steps ≡ this mod H.

    Offsets (p+1)·H/P, taken mod H, space the P fragments evenly, H/P steps apart; the last
    fragment lands on multiples of H, so with P = 1 the only fragment is DiLoCo's every-H sync.
    """
    if not 0 <= p < P:
        raise ValueError(f"fragment {p} out of range for P={P}")
    return ((p + 1) * H // P) % H


def _window(apply_step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None) -> int:
    """The window length of the round applied after inner step ``apply_step``, its schedule checked."""
    h = H if warmup is None else warmup.window(apply_step, H)
    if window_problem(h, P, tau) is not None:
        raise ValueError(
            f"invalid schedule H={h}, P={P}, tau={tau}: need H >= 1, P >= 1, P dividing H and 0 <= tau < H/P "
            "(validate_schedule explains which algo.* key to change)"
        )
    return h


def _check_step(step: int, least: int) -> None:
    if step < least:
        raise ValueError(f"step counts completed inner steps and must be >= {least}, got {step}")


def fragments_to_apply(
    step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None = None, end: int = 0
) -> list[int]:
    """Fragments whose outer update is applied after inner step ``step`` (sorted); ``end``: the job's
    last step T (0: none), whose shorter last window applies every fragment at T."""
    _check_step(step, 1)
    last = last_window(end, H, warmup)
    if last is not None and step > last.start:
        return list(range(P)) if step == last.end else []
    h = _window(step, H, P, tau, warmup)
    return [p for p in range(P) if step % h == fragment_offset(p, h, P)]


def fragments_to_launch(
    step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None = None, end: int = 0
) -> list[int]:
    """Fragments whose all-reduce is launched after inner step ``step`` (sorted): τ steps before their apply.

    The first apply of any fragment is at step ≥ H/P > τ, so every launch falls on a step ≥ 1. A
    launch up to E applies by E (the next apply after E is H/P > τ steps later), so the rounds
    before the last window (``LastWindow``) are the same as in a job that ends at E.
    """
    _check_step(step, 1)
    last = last_window(end, H, warmup)
    if last is not None and step > last.start:
        return list(range(P)) if step == last.launch_step(tau) else []
    h = _window(step + tau, H, P, tau, warmup)
    return [p for p in range(P) if (step + tau) % h == fragment_offset(p, h, P)]


def next_launch_step(step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None = None, end: int = 0) -> int:
    """The first inner step after ``step`` at which some fragment's all-reduce is launched.

    Launches fall every H/P steps, τ steps before the applies at multiples of H/P; within a
    warm-up every H₀/P steps, up to the launch of the apply at W; in the job's last window
    (``end``: its last step) once, for the apply at the end. After that one, T + 1: no launch is left.
    """
    _check_step(step, 0)
    launch = _next_regular_launch(step, H, P, tau, warmup)
    last = last_window(end, H, warmup)
    if last is None or launch + tau <= last.start:
        return launch
    return last.launch_step(tau) if step < last.launch_step(tau) else last.end + 1


def _next_regular_launch(step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None) -> int:
    if warmup is not None and step + tau < warmup.steps:
        launch = _next_in_windows(step, _window(step + tau + 1, H, P, tau, warmup), P, tau)
        if launch + tau <= warmup.steps:
            return launch
        step = warmup.steps - tau  # the apply at W was the warm-up's last; H windows from there
    return _next_in_windows(step, _window(step + tau + 1, H, P, tau, warmup), P, tau)


def _next_in_windows(step: int, h: int, P: int, tau: int) -> int:
    spacing = h // P
    ahead = (-tau - step) % spacing
    return step + (ahead or spacing)


def skip_target(
    step: int, open_step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None = None, end: int = 0
) -> int:
    """Time-bounded windows: the inner step a group after ``step`` goes on from, when its peers
    opened a round at ``open_step`` (0: none known).

    It skips to the round only if that is its own next launch and it is more than one inner
    step away; one step behind, it takes that step as usual, so groups of equal speed, a
    fraction of a step apart, run exactly the step-bounded schedule.
    """
    if open_step == next_launch_step(step, H, P, tau, warmup, end) and open_step > step + 1:
        return open_step
    return step
