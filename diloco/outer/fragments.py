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


def block_of(name: str) -> int | None:
    """The transformer block parameter ``name`` lives in: its first numbered component
    (``layers.3.…``, Hugging Face's ``model.layers.3.…``, GPT-2's ``transformer.h.3.…``); None outside blocks.

    Components that wrappers insert (torch.compile, activation checkpointing) are skipped first.
    """
    parts = [c for c in name.split(".") if c not in _WRAPPER_COMPONENTS]
    return next((int(c) for c in parts[1:] if c.isdigit()), None)


def count_blocks(names: list[str]) -> int:
    """The model's transformer blocks, read from its parameter names (``block_of``); 0 if none is numbered."""
    return max((b for b in map(block_of, names) if b is not None), default=-1) + 1


def fragment_parameter_names(
    names: list[str], n_blocks: int, fragments: int, pattern: Pattern = "strided"
) -> list[list[str]]:
    """``names`` (a model's ``named_parameters()`` order) split into P lists, keeping their order.

    A block's parameters go with the block. The parameters before every block (the embedding)
    sit at the input and travel with fragment 0, which holds the first block; those after every
    block (final norm, output head) sit at the output and travel with fragment P−1, which holds
    the last block whenever P divides the number of blocks (strided) and always for sequential.
    With tied embeddings the shared weight is named once, at the embedding, and goes to fragment 0.
    """
    if fragments == 1:
        return [list(names)]
    owner = _block_fragment(n_blocks, fragments, pattern)
    blocks = [block_of(n) for n in names]
    numbered = [i for i, b in enumerate(blocks) if b is not None]
    out: list[list[str]] = [[] for _ in range(fragments)]
    for i, (name, block) in enumerate(zip(names, blocks, strict=True)):
        if block is not None:
            if block >= n_blocks:
                raise ValueError(f"parameter {name} is in block {block}, but the model has {n_blocks} blocks")
            out[owner[block]].append(name)
        elif numbered and i < numbered[0]:
            out[0].append(name)
        elif numbered and i > numbered[-1]:
            out[-1].append(name)
        else:
            raise ValueError(
                f"no fragment for parameter {name!r}: Streaming DiLoCo splits a model by its numbered blocks "
                "(layers.<i>.*), with what comes before them in fragment 0 and after them in the last; "
                "this one is between blocks or the model has none (use one fragment)"
            )
    return out
