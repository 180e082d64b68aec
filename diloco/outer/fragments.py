"""Streaming DiLoCo's fragments and their schedule, as pure functions of plain ints.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits the model's transformer
blocks into P fragments and syncs one fragment at a time, staggered evenly over the window
of H inner steps, so the peak bandwidth drops by P. Each fragment's all-reduce is launched τ
inner steps before its result is applied, overlapping communication with computation. With
P = 1 and τ = 0 this is plain DiLoCo (arXiv 2311.08105): one outer step every H steps. A
``SyncWarmup`` makes the job's first W inner steps sync every H₀ < H steps instead
(post-local SGD, Lin et al. 2020, arXiv 1808.07217: infrequent syncs from the start cost
quality that frequent syncs in the first phase keep).

Steps count completed inner steps: ``step = s`` means "after inner step s", s ≥ 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pattern = Literal["strided", "sequential"]

# Components that wrappers insert into parameter names without changing the model
# (torch.compile, activation checkpointing, FSDP1); peers must agree whatever they wrap.
_WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def partition_blocks(n_blocks: int, fragments: int, pattern: Pattern = "strided") -> list[list[int]]:
    """The transformer blocks of each fragment, ascending.

    strided: fragment p holds blocks p, p+P, p+2P, … — each fragment spans the whole depth,
    the paper's default, which it found better than contiguous fragments.
    sequential: contiguous runs; the first n_blocks % P fragments hold one block more.
    """
    if n_blocks < 1 or not 1 <= fragments <= n_blocks:
        raise ValueError(f"need 1 <= fragments <= n_blocks, got fragments={fragments}, n_blocks={n_blocks}")
    if pattern == "strided":
        return [list(range(p, n_blocks, fragments)) for p in range(fragments)]
    if pattern == "sequential":
        base, extra = divmod(n_blocks, fragments)
        out, start = [], 0
        for p in range(fragments):
            size = base + (1 if p < extra else 0)
            out.append(list(range(start, start + size)))
            start += size
        return out
    raise ValueError(f"unknown fragment pattern {pattern!r}; expected 'strided' or 'sequential'")


def _block_fragment(n_blocks: int, fragments: int, pattern: Pattern) -> list[int]:
    """block index → fragment index."""
    owner = [0] * n_blocks
    for p, blocks in enumerate(partition_blocks(n_blocks, fragments, pattern)):
        for b in blocks:
            owner[b] = p
    return owner


def _fragment_of(parts: list[str], name: str, owner: list[int], fragments: int) -> int:
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        block = int(parts[1])
        if block >= len(owner):
            raise ValueError(f"parameter {name} is in block {block}, but the model has {len(owner)} blocks")
        return owner[block]
    if parts[0] == "tok_embeddings":
        return 0
    if parts[0] in ("norm", "output"):
        return fragments - 1
    raise ValueError(f"no fragment for parameter {name!r}; expected tok_embeddings.*, layers.<i>.*, norm.* or output.*")


def fragment_of_parameter(name: str, n_blocks: int, fragments: int, pattern: Pattern = "strided") -> int:
    """The fragment that syncs parameter ``name`` (a ``Transformer.named_parameters()`` name).

    ``layers.{i}.…`` belongs with block i. The embedding sits at the input, so it travels
    with fragment 0, which holds the first block; the final norm and the output head sit at
    the output, so they travel with fragment P−1, which holds the last block whenever P
    divides the number of blocks (strided) and always for sequential. With tied embeddings
    the shared weight is named ``tok_embeddings.weight`` and goes to fragment 0.
    """
    parts = [c for c in name.split(".") if c not in _WRAPPER_COMPONENTS]
    return _fragment_of(parts or [""], name, _block_fragment(n_blocks, fragments, pattern), fragments)


def fragment_parameter_names(
    names: list[str], n_blocks: int, fragments: int, pattern: Pattern = "strided"
) -> list[list[str]]:
    """``names`` split into P lists by ``fragment_of_parameter``, keeping their input order."""
    owner = _block_fragment(n_blocks, fragments, pattern)
    out: list[list[str]] = [[] for _ in range(fragments)]
    for name in names:
        parts = [c for c in name.split(".") if c not in _WRAPPER_COMPONENTS]
        out[_fragment_of(parts or [""], name, owner, fragments)].append(name)
    return out


@dataclass(frozen=True)
class SyncWarmup:
    """Windows of ``every`` (H₀) inner steps for the applies up to inner step ``steps`` (W), then H.

    W is a multiple of H and H₀ divides H (``AlgoConfig.sync_warmup_window``), so the last
    warm-up window ends where an H window would: the windows after it, checkpoints and the
    job's last round fall where they would without the warm-up.
    """

    every: int
    steps: int

    def window(self, apply_step: int, H: int) -> int:
        return self.every if apply_step <= self.steps else H


def _window(apply_step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None) -> int:
    """The window length H of the round applied after inner step ``apply_step``, its schedule checked."""
    h = H if warmup is None else warmup.window(apply_step, H)
    if h < 1 or P < 1 or h % P != 0 or not 0 <= tau < h // P:
        raise ValueError(
            f"invalid schedule H={h}, P={P}, tau={tau}: need H >= 1, P >= 1, P dividing H and 0 <= tau < H/P "
            "(validate_schedule explains which algo.* key to change)"
        )
    return h


def fragment_offset(p: int, H: int, P: int) -> int:
    """Where in the H-step window fragment p is applied: after inner steps ≡ this mod H.

    Offsets (p+1)·H/P, taken mod H, space the P fragments evenly, H/P steps apart; the last
    fragment lands on multiples of H, so with P = 1 the only fragment is DiLoCo's every-H sync.
    """
    if not 0 <= p < P:
        raise ValueError(f"fragment {p} out of range for P={P}")
    return ((p + 1) * H // P) % H


def _check_step(step: int, least: int) -> None:
    if step < least:
        raise ValueError(f"step counts completed inner steps and must be >= {least}, got {step}")


def fragments_to_apply(step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None = None) -> list[int]:
    """Fragments whose outer update is applied after inner step ``step`` (sorted)."""
    _check_step(step, 1)
    h = _window(step, H, P, tau, warmup)
    return [p for p in range(P) if step % h == fragment_offset(p, h, P)]


def fragments_to_launch(step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None = None) -> list[int]:
    """Fragments whose all-reduce is launched after inner step ``step`` (sorted): τ steps before their apply.

    The first apply of any fragment is at step ≥ H/P > τ, so every launch falls on a step ≥ 1.
    """
    _check_step(step, 1)
    h = _window(step + tau, H, P, tau, warmup)
    return [p for p in range(P) if (step + tau) % h == fragment_offset(p, h, P)]


def next_launch_step(step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None = None) -> int:
    """The first inner step after ``step`` at which some fragment's all-reduce is launched.

    Launches fall every H/P steps, τ steps before the applies at multiples of H/P; within a
    warm-up every H₀/P steps, up to the launch of the apply at W.
    """
    _check_step(step, 0)
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


def skip_target(step: int, open_step: int, H: int, P: int, tau: int, warmup: SyncWarmup | None = None) -> int:
    """Time-bounded windows: the inner step a group after ``step`` goes on from, when its peers
    opened a round at ``open_step`` (0: none known).

    It skips to the round only if that is its own next launch and it is more than one inner
    step away; one step behind, it takes that step as usual, so groups of equal speed, a
    fraction of a step apart, run exactly the step-bounded schedule.
    """
    if open_step == next_launch_step(step, H, P, tau, warmup) and open_step > step + 1:
        return open_step
    return step
