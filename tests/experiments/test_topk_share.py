"""experiments/outer_recipe/topk_share.py: the share top-k keeps is the codec's selection, and a short run
gives one row per inner optimizer and quantity, the first window's two shares equal (e starts empty)."""

from __future__ import annotations

import json

import pytest
import torch

from diloco.outer.sparse import TopK
from experiments.outer_recipe.topk_share import kept_share, main


def test_the_share_kept_is_the_largest_entries_of_each_chunk():
    x = torch.full((2 * 4096,), 0.1)
    x[:41] = 10.0  # the first chunk's top 1% (41 of 4,096) is all its large entries
    x[4096 : 4096 + 82] = -10.0  # the second chunk holds twice that: half of them are kept
    share = kept_share(TopK(0.01, value_bits=32), x)
    big, small = 123 * 100.0, (2 * 4096 - 123) * 0.01
    assert share == pytest.approx((82 * 100.0 + 0) / (big + small), rel=1e-5)


@pytest.mark.slow
def test_a_short_run_measures_both_inner_optimizers(tmp_path, capsys):
    main(["--model", "tiny", "--steps", "20", "--h", "10", "--results", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[:2] for line in lines[4:8]] == [
        ["| adamw", "Δ"],
        ["| adamw", "β·e + Δ"],
        ["| muon", "Δ"],
        ["| muon", "β·e + Δ"],
    ]
    found = json.loads((tmp_path / "topk_share.json").read_text())
    for records in found.values():
        assert [r["step"] for r in records] == [10, 20]
        assert records[0]["delta"] == pytest.approx(records[0]["with_error"])
        assert all(0 < r["delta"] < 1 and 0 < r["with_error"] < 1 for r in records)
