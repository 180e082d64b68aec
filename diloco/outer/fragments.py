"""Streaming DiLoCo's fragments: which transformer blocks and parameters each of the P holds.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits the model's transformer
blocks into P fragments and syncs one fragment at a time, staggered evenly over the window
of H inner steps, so the peak bandwidth drops by P. When each fragment is launched and
applied is ``diloco/schedule.py``'s; with P = 1 this is plain DiLoCo (arXiv 2311.08105).
"""

from __future__ import annotations

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
