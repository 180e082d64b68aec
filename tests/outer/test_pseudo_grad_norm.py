"""``outer/pseudo_grad_norm``: each rank's share of ‖Δ̄‖² counts the entries it alone holds, so the
group's sum is the whole fragment's whatever the layout (tests/test_tensor_parallel.py and
tests/test_pipeline_parallel.py hold the logged norms of every layout to the plain run's)."""

from __future__ import annotations

import torch

from diloco.ft.state import counted_here
from diloco.outer.diloco_sync import Fragment, owned_square_sum


def fragment(sizes: list[int], owned: list[bool] | None) -> Fragment:
    local = [torch.zeros(n) for n in sizes]
    return Fragment(index=0, local=local, global_=[], optimizer=None, owned=owned)


def test_a_rank_counts_only_the_tensors_it_owns_in_the_flat_average():
    average = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])  # tensors of 2, 3 and 1 entries, flat in order
    assert owned_square_sum(average, fragment([2, 3, 1], [True, False, True])) == 1 + 4 + 36
    assert owned_square_sum(average, fragment([2, 3, 1], None)) == sum(v * v for v in range(1, 7))
    assert owned_square_sum(torch.zeros(0), fragment([0], [True])) == 0.0, "a stage's empty placeholder"


def test_a_plain_tensor_is_this_workers_alone():
    assert counted_here(torch.zeros(3))
