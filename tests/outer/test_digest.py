"""The state digest: the same bytes whatever the thread count, a different one for any changed byte or name."""

from __future__ import annotations

import torch

from diloco.outer import digest
from diloco.outer.digest import state_digest


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "layers.0.w": torch.randn(3000),
        "layers.0.w.momentum": torch.randn(1000).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0),
    }


def test_the_digest_is_the_same_on_one_thread_and_on_a_pool_of_chunks(monkeypatch):
    serial = state_digest(_state())
    monkeypatch.setattr(digest, "CHUNK_BYTES", 1024)  # 12,000 bytes in 12 chunks: the pool hashes them
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        pooled = state_digest(_state())
    finally:
        torch.set_num_threads(threads)
    assert 3 in digest._pools
    assert len(serial) == 32
    # The chunking is part of the digest's definition, so the serial form must hash the same chunks.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert state_digest(_state()) == pooled
    monkeypatch.setattr(digest, "CHUNK_BYTES", 16 << 20)
    assert state_digest(_state()) == serial


def test_any_changed_byte_or_name_changes_the_digest():
    base = state_digest(_state())
    changed = _state()
    changed["layers.0.w"][2999] += 1e-3
    assert state_digest(changed) != base
    renamed = _state()
    renamed["layers.0.v"] = renamed.pop("layers.0.w")
    assert state_digest(renamed) != base
