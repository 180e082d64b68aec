"""Healing transport: pack/unpack and validation in one process; real Gloo lanes in two processes."""

from __future__ import annotations

import json
import os
import queue
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diloco.ft import transport
from diloco.ft.transport import (
    ChunkSums,
    StateBundle,
    TransferError,
    lay_out_state,
    pack_state,
    payload_checksum,
    recv_state,
    send_state,
    unpack_state,
)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, so bit-exactness (NaN, -0.0, bf16 rounding) is what gets compared."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want), (list(got), list(want))
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype, (name, got[name].dtype, ref.dtype)
        assert got[name].shape == ref.shape, (name, got[name].shape, ref.shape)
        assert torch.equal(_raw(got[name]), _raw(ref)), name


def mixed_tensors(scale: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype the healing state holds, plus the awkward shapes (0-d, empty, non-contiguous)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "global.0.0": torch.randn(64 * scale, 128, generator=g),
        "outer.0.momentum": torch.randn(1000 * scale, generator=g).to(torch.bfloat16),
        "inner.0.step": torch.tensor(17.0, dtype=torch.float64),
        "ids": torch.randint(-(2**40), 2**40, (5000 * scale,), generator=g, dtype=torch.int64),
        "bytes": torch.randint(0, 256, (3001 * scale,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(9, 5, generator=g).to(torch.float16).t(),
        "special": torch.tensor([float("nan"), -0.0, float("inf")]),
    }


def zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


def edit_header(header: bytes, edit) -> bytes:
    doc = json.loads(header)
    edit(doc)
    return json.dumps(doc).encode()


# ---------------------------------------------------------------- one process: pack / unpack


def test_round_trip_mixed_dtypes_bit_exact() -> None:
    tensors = mixed_tensors()
    header, payload, checksum = pack_state(StateBundle(tensors, {"committed": 3, "inner_step": 300, "loss": 2.5}))
    got = unpack_state(header, payload, checksum, zeros_like(tensors))
    assert_bit_equal(got.tensors, tensors)
    assert got.meta == {"committed": 3, "inner_step": 300, "loss": 2.5}


@pytest.mark.parametrize("chunk", [64, 1000, 4096, 1 << 20])
def test_the_laid_out_payload_reads_chunk_by_chunk_as_the_packed_bytes_without_packing_the_whole(chunk: int) -> None:
    tensors = mixed_tensors(scale=3)
    header, packed, _ = pack_state(StateBundle(tensors, {}))
    laid_header, laid_out = lay_out_state(StateBundle(tensors, {}))
    assert laid_header == header and laid_out.total == packed.numel()
    starts = range(0, laid_out.total, chunk)
    # Each chunk as _stream asks for it, summed as the sender does and taken before a later one may reuse its buffer.
    sums, read = ChunkSums(), []
    for i, start in enumerate(starts):
        piece = laid_out.chunk(i, start, min(chunk, laid_out.total - start))
        sums.add(piece)
        read.append(piece.clone())
    assert torch.equal(torch.cat(read), packed)
    assert sums.value == payload_checksum(packed, chunk)  # what the receiver takes of the same bytes
    first = tensors["global.0.0"]  # the payload's first tensor, at offset 0
    assert laid_out.chunk(0, 0, min(chunk, first.numel() * 4)).data_ptr() == first.data_ptr()  # a view, no copy


def test_header_lists_tensors_in_order_with_aligned_offsets() -> None:
    tensors = mixed_tensors()
    header, payload, _ = pack_state(StateBundle(tensors, {}))
    doc = json.loads(header)
    assert [e["name"] for e in doc["tensors"]] == list(tensors)
    assert all(e["offset"] % transport.ALIGN_BYTES == 0 for e in doc["tensors"])
    assert doc["payload_nbytes"] == payload.numel() == doc["tensors"][-1]["offset"] + doc["tensors"][-1]["nbytes"]
    assert doc["tensors"][1]["dtype"] == "bfloat16" and doc["tensors"][2]["shape"] == []


def test_empty_state_round_trips() -> None:
    header, payload, checksum = pack_state(StateBundle({}, {"committed": 0}))
    assert payload.numel() == 0
    assert unpack_state(header, payload, checksum, {}).meta == {"committed": 0}


def test_unpacked_tensors_do_not_alias_the_template() -> None:
    tensors = mixed_tensors()
    template = zeros_like(tensors)
    header, payload, checksum = pack_state(StateBundle(tensors, {}))
    unpack_state(header, payload, checksum, template)
    assert all(not v.any() for v in template.values())


def test_meta_that_is_not_json_is_refused_at_pack() -> None:
    with pytest.raises(TypeError, match="JSON-serializable"):
        pack_state(StateBundle({"a": torch.ones(2)}, {"step": object()}))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t: t.pop("ids"), "missing \\[\\], unexpected \\['ids'\\]"),  # sender has one we lack
        (lambda t: t.update(extra=torch.ones(3)), "missing \\['extra'\\]"),  # we expect one it lacks
        (lambda t: t.update(renamed=t.pop("bytes")), "missing \\['renamed'\\], unexpected \\['bytes'\\]"),
        (lambda t: t.update(ids=t.pop("ids")), "#3: expected 'bytes', got 'ids'"),  # same names, other order
        (lambda t: t.update({"outer.0.momentum": t["outer.0.momentum"].float()}), "'outer.0.momentum': dtype"),
        (lambda t: t.update({"global.0.0": t["global.0.0"].t()}), "'global.0.0': shape"),
        (lambda t: t.update({"inner.0.step": t["inner.0.step"].reshape(1)}), "'inner.0.step': shape"),
    ],
)
def test_mismatched_template_is_refused_with_the_tensor_name(change, match: str) -> None:
    tensors = mixed_tensors()
    header, payload, checksum = pack_state(StateBundle(dict(tensors), {}))
    template = zeros_like(tensors)
    change(template)
    with pytest.raises(TransferError, match=match):
        unpack_state(header, payload, checksum, template)


def test_corrupted_payload_byte_fails_the_checksum() -> None:
    tensors = mixed_tensors()
    header, payload, checksum = pack_state(StateBundle(tensors, {}))
    payload[payload.numel() // 2] ^= 0x01
    with pytest.raises(TransferError, match="checksum mismatch"):
        unpack_state(header, payload, checksum, zeros_like(tensors))


@pytest.mark.parametrize("chunk", [8, 13, 64])
def test_the_checksum_changes_with_any_one_byte_and_with_chunks_out_of_order(chunk: int) -> None:
    payload = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    want = payload_checksum(payload, chunk)
    for at in range(payload.numel()):
        for bit in (0x01, 0x80):
            changed = payload.clone()
            changed[at] ^= bit
            assert payload_checksum(changed, chunk) != want, (at, bit)
    swapped = torch.cat([payload[chunk : 2 * chunk], payload[:chunk], payload[2 * chunk :]])
    assert payload_checksum(swapped, chunk) != want
    assert torch.tensor([2**62] * 4).sum().item() == 0  # the int64 sum it rests on wraps mod 2^64


def test_truncated_payload_is_refused() -> None:
    tensors = mixed_tensors()
    header, payload, checksum = pack_state(StateBundle(tensors, {}))
    with pytest.raises(TransferError, match="payload is"):
        unpack_state(header, payload[:-1].clone(), checksum, zeros_like(tensors))


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b'{"format": "diloco-state", "version": 1, ', "not valid UTF-8 JSON"),
        (b"\xff\xfe\x00", "not valid UTF-8 JSON"),
        (b"[" * 100_000, "not valid UTF-8 JSON"),  # nesting bomb: RecursionError, not a crash
        (b"[]", "not a 'diloco-state' header"),
        (b"null", "not a 'diloco-state' header"),
    ],
)
def test_malformed_header_is_refused(header: bytes, match: str) -> None:
    _, payload, checksum = pack_state(StateBundle({"a": torch.ones(2)}, {}))
    with pytest.raises(TransferError, match=match):
        unpack_state(header, payload, checksum, {"a": torch.zeros(2)})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(version=1), "version 1 received"),
        (lambda d: d.pop("checksum"), "names no chunk-sum64 checksum"),
        (lambda d: d["checksum"].update(algo="crc32"), "names no chunk-sum64 checksum"),
        (lambda d: d.update(meta=[1]), "meta must be a JSON object"),
        (lambda d: d.update(tensors={"a": 1}), "'tensors' must be a list"),
        (lambda d: d["tensors"][1].update(offset=8), "'b': offset expected 64, got 8"),
        (lambda d: d["tensors"][0].update(nbytes=4), "'a': nbytes expected 8, got 4"),
        (lambda d: d.update(payload_nbytes=10**12), "template implies"),
    ],
)
def test_inconsistent_header_fields_are_refused(edit, match: str) -> None:
    tensors = {"a": torch.ones(2), "b": torch.arange(3)}
    header, payload, checksum = pack_state(StateBundle(tensors, {}))
    with pytest.raises(TransferError, match=match):
        unpack_state(edit_header(header, edit), payload, checksum, zeros_like(tensors))


# ---------------------------------------------------------------- two processes over a real Gloo lane
# Children report plain strings through a multiprocessing Queue; nothing crosses the lane but
# the transport's own raw tensors.

TIMEOUT_S = 20.0
DEAD_PEER_TIMEOUT_S = 600.0  # far past run_pair's hang guard: a receiver that waited for it fails the test
SILENCE_S = 3.0  # how long the silent sender stays silent, well past the receiver's 0.5 s


def _roundtrip(rank: int, pg) -> str:
    tensors = mixed_tensors(scale=40)  # ~3 MB: 12 chunks of 256 KiB
    if rank == 0:
        send_state(pg, 1, StateBundle(tensors, {"committed": 7}), TIMEOUT_S)
        return "sent"
    got = recv_state(pg, 0, zeros_like(tensors), TIMEOUT_S)
    assert_bit_equal(got.tensors, tensors)
    assert got.meta == {"committed": 7}, got.meta
    return "bit-exact"


def _corrupt(rank: int, pg) -> str:
    tensors = mixed_tensors(scale=40)
    if rank == 0:
        with pytest.raises(TransferError, match="receiver refused the payload"):
            send_state(pg, 1, StateBundle(tensors, {"committed": 7}), TIMEOUT_S)
        return "told"
    add, flipped = ChunkSums.add, []

    def add_flipped_once(sums: ChunkSums, piece: torch.Tensor) -> None:
        if not flipped:  # a bit of the first chunk changed on the way in, after the sender summed it
            piece[piece.numel() // 2] ^= 0x80
            flipped.append(True)
        add(sums, piece)

    ChunkSums.add = add_flipped_once
    template = mixed_tensors(scale=40, seed=1)
    before = {k: v.clone() for k, v in template.items()}
    with pytest.raises(TransferError, match="checksum mismatch"):
        recv_state(pg, 0, template, TIMEOUT_S)
    assert_bit_equal(template, before)
    return "refused"


def _refused_then_ok(rank: int, pg) -> str:
    tensors = mixed_tensors(scale=40)
    if rank == 0:
        # The refusal itself, not "header verdict: timed out": the sender heard the verdict, not its deadline.
        with pytest.raises(TransferError, match="receiver refused the header"):
            send_state(pg, 1, StateBundle(tensors, {}), TIMEOUT_S)
        send_state(pg, 1, StateBundle(tensors, {"committed": 8}), TIMEOUT_S)
        with pytest.raises(TransferError, match="header: (timed out after 1 s|peer gone)"):  # never taken
            send_state(pg, 1, StateBundle(tensors, {}), 1.0)
        return "told, then sent"
    wrong = zeros_like(tensors)
    wrong["ids"] = wrong["ids"][1:]
    with pytest.raises(TransferError, match=re.escape("tensor 'ids': shape expected [199999], got [200000]")):
        recv_state(pg, 0, wrong, TIMEOUT_S)
    got = recv_state(pg, 0, zeros_like(tensors), TIMEOUT_S)  # the same lane: no stale message in the way
    assert_bit_equal(got.tensors, tensors)
    with pytest.raises(TransferError, match="header of [0-9]+ bytes refused \\(limit 64\\)"):
        recv_state(pg, 0, zeros_like(tensors), TIMEOUT_S, max_header_bytes=64)  # refused before allocating
    return f"refused, then {got.meta}"


def _failure(src_pg, template: dict[str, torch.Tensor], timeout_s: float) -> str:
    """Receive what must fail; report why."""
    with pytest.raises(TransferError) as caught:
        recv_state(src_pg, 0, template, timeout_s)
    return str(caught.value)


def _sender_dies(rank: int, pg) -> str:
    tensors = mixed_tensors(scale=40)
    if rank == 0:

        def die(*args, **kwargs):
            os._exit(0)  # size prefix and header are out, the header accepted; the payload never comes

        transport._stream = die
        send_state(pg, 1, StateBundle(tensors, {}), TIMEOUT_S)
        raise AssertionError("unreachable")
    return _failure(pg, zeros_like(tensors), DEAD_PEER_TIMEOUT_S)


def _sender_silent(rank: int, pg) -> str:
    if rank == 0:
        time.sleep(SILENCE_S)  # alive but never sends: only the receiver's deadline ends this
        return "silent"
    return _failure(pg, {"a": torch.zeros(3)}, 0.5)


SCENARIOS = {
    "roundtrip": _roundtrip,
    "corrupt": _corrupt,
    "refused": _refused_then_ok,
    "dies": _sender_dies,
    "silent": _sender_silent,
}


def _child(rank: int, port: int, scenario: str, results) -> None:
    """One lane member: join a bare ProcessGroupGloo (not the default group), run the scenario."""
    try:
        transport.CHUNK_BYTES = 256 << 10
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"lane0/{scenario}", store), rank, 2, timedelta(seconds=TIMEOUT_S))
        results.put((rank, "ok", SCENARIOS[scenario](rank, pg)))
    except BaseException as error:  # noqa: BLE001 - report everything; the parent asserts on it
        results.put((rank, "error", f"{type(error).__name__}: {error}"))
    results.close()
    results.join_thread()
    os._exit(0)  # skip the lane's teardown: a peer may be gone, and the test is over


def run_pair(scenario: str, expect: tuple[int, ...] = (0, 1), limit_s: float = 60.0) -> dict[int, str]:
    """Spawn rank 0 (sender) and rank 1 (receiver); the store lives here, so either may die.

    Each rank's result, in the order they arrived; ``limit_s`` is a hang guard, not a measurement."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(rank, store.port, scenario, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    got: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + limit_s
    try:
        while set(got) != set(expect):
            try:
                rank, status, text = results.get(timeout=0.5)
                got[rank] = (status, text)
            except queue.Empty:  # a child that died before reporting must not cost the whole limit
                if time.monotonic() > deadline or not any(proc.is_alive() for proc in procs):
                    codes = [proc.exitcode for proc in procs]
                    pytest.fail(f"{scenario}: no result from ranks {sorted(set(expect) - set(got))}: {got} {codes}")
    finally:
        for proc in procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = {rank: text for rank, (status, text) in got.items() if status != "ok"}
    assert not errors, f"{scenario}: {errors}"
    return {rank: text for rank, (_, text) in got.items()}


@pytest.mark.slow
def test_two_processes_transfer_several_chunks_bit_exactly() -> None:
    assert run_pair("roundtrip") == {0: "sent", 1: "bit-exact"}


@pytest.mark.slow
def test_payload_corrupted_after_pack_is_refused_and_template_untouched() -> None:
    assert run_pair("corrupt") == {0: "told", 1: "refused"}


@pytest.mark.slow
def test_refused_header_tells_the_sender_at_once_and_leaves_the_lane_usable() -> None:
    assert run_pair("refused") == {0: "told, then sent", 1: "refused, then {'committed': 8}"}


@pytest.mark.slow
def test_sender_dying_after_header_fails_the_receiver_long_before_its_timeout() -> None:
    """The lost peer itself ends the wait: the receiver's 600 s timeout would outlast run_pair's hang guard."""
    message = run_pair("dies", expect=(1,))[1]
    assert re.search(r"payload chunk \d+/", message) and "peer gone" in message, message  # whichever chunk noticed


@pytest.mark.slow
def test_silent_sender_times_out_the_receiver() -> None:
    """The receiver gives up on its own deadline ("timed out" is said only once it passed) while the
    sender is still silent: its result arrives first."""
    got = run_pair("silent")
    assert list(got) == [1, 0], got
    assert "size prefix: timed out after 0.5 s" in got[1], got[1]
