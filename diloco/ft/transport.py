"""Healing transport: one lane moves its shard of the live state from a peer group, as raw bytes.

A group that is behind receives θ_g, the outer-optimizer state and the inner state from a
live peer over its lane, never from a checkpoint (docs/design.md, invariant 12); each lane carries its
own FSDP shard, so lanes transfer in parallel. Wire protocol, one tag (S sender, R receiver):
  1. S→R int64 ``[header_nbytes, payload_nbytes, chunk_nbytes]``; the chunk size travels
     because Gloo aborts a process that receives a message larger than the buffer it posted;
  2. S→R the header, UTF-8 JSON: format, version, tensor table (name, dtype, shape, offset,
     nbytes, in insertion order), meta, the checksum's algorithm;
  3. R→S int64 verdict on the header: a refused sender stops here instead of blocking until
     its timeout, and both sides end at the same message, so no stale message stays queued;
  4. S→R the payload, every tensor's raw bytes 64-byte aligned, in chunks of chunk_nbytes;
  5. S→R int64 checksum of the payload (``ChunkSums``), taken by the sender chunk by chunk as
     they went out, beside the chunks still on the wire, as the receiver takes its own as they
     arrive: a checksum in the header would be one more pass over the payload before its first byte;
  6. R→S int64 verdict on the payload's checksum: send_state returns only on verified arrival.
docs/design.md, invariant 5: nothing received is unpickled; the header is checked field by field against a
template of the state the receiver holds, and bytes land in new staging buffers, so a failed
transfer leaves the live state untouched. All waits share one deadline. After a timeout or a
lost peer the lane may still hold posted operations: rebuild it (lanes are per quorum anyway).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from diloco.byte_view import byte_view
from diloco.ft.lanes import CancelScope, LaneError, wait_work

FORMAT = "diloco-state"
FORMAT_VERSION = 2  # 1: a CRC32 of the payload in the header
CHUNK_BYTES = 16 << 20  # largest single Gloo message: multi-GB shards never need one giant buffer
ALIGN_BYTES = 64  # every tensor starts aligned, so unpacking is a zero-copy dtype view
CHECKSUM = "chunk-sum64"
_WINDOW = 4  # payload chunks in flight: keeps the socket busy without posting thousands of ops
_TAG = 0
_ACCEPT, _REFUSE = 1, 0  # the receiver's verdicts on the header and on the payload

Lane = dist.ProcessGroup | dist.Backend  # a lane is a bare ProcessGroupGloo (a Backend)


@dataclass
class StateBundle:
    """One lane's shard of the state: CPU tensors plus JSON-serializable meta (e.g. the step)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


class TransferError(RuntimeError):
    """A transfer failed, timed out, or delivered state that does not match the template."""


def _table(tensors: dict[str, torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """Where each tensor's bytes sit in the payload; the receiver recomputes it from its template."""
    table: list[dict[str, Any]] = []
    end = 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"state entries must be str -> Tensor, got {name!r} -> {type(t).__name__}")
        offset = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        nbytes = t.numel() * t.element_size()
        dtype = str(t.dtype).removeprefix("torch.")
        table.append({"name": name, "dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        end = offset + nbytes
    return table, end


_MASK = (1 << 64) - 1
_FOLD = 0x100000001B3  # odd, so a change in any chunk's sum changes the fold


def chunk_sum(piece: torch.Tensor) -> int:
    """The bytes of a flat uint8 ``piece`` read as int64 words (the last zero-padded), summed mod 2^64."""
    whole = piece.numel() // 8 * 8
    head = piece[:whole]
    if head.storage_offset() % 8:  # a chunk at a place no int64 view may start (a chunk size not a multiple of 8)
        head = head.clone()
    total = int(head.view(torch.int64).sum()) if whole else 0  # torch's int64 sum wraps: mod 2^64, in any order
    if whole < piece.numel():
        padded = torch.zeros(8, dtype=torch.uint8)
        padded[: piece.numel() - whole] = piece[whole:]
        total += int(padded.view(torch.int64))
    return total & _MASK


class ChunkSums:
    """The payload's checksum, chunk by chunk in order: c ← c·F + s_k (mod 2^64, F odd), s_k chunk k's
    ``chunk_sum``. It moves at the memory's speed (about 5x zlib's CRC32 here), so both sides take it
    beside the wire. Any one changed word (so any changed byte), and chunks out of order, change it;
    it is no hash: two changes that cancel in one chunk's sum go unseen."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, piece: torch.Tensor) -> None:
        self.value = (self.value * _FOLD + chunk_sum(piece)) & _MASK

    def tensor(self) -> torch.Tensor:
        """The value as one int64 (two's complement), as it goes on the wire."""
        return torch.tensor([self.value - (1 << 64) if self.value >> 63 else self.value], dtype=torch.int64)


def payload_checksum(payload: torch.Tensor, chunk: int) -> int:
    """``ChunkSums`` of a whole payload in ``chunk``-byte chunks."""
    sums = ChunkSums()
    for start in range(0, payload.numel(), chunk):
        sums.add(payload[start : start + chunk])
    return sums.value


class LaidOut:
    """The payload as the bundle's own tensors at the table's offsets, never packed whole.

    Its bytes are read a chunk at a time (``chunk``): a chunk inside one tensor is a view of that
    tensor, one across tensors or their padding is assembled in one of a few reused buffers. At 150M
    parameters packing the 2.4 GB state into a new buffer first took 8 s of page faults and copies,
    ten times the wire's time for the same bytes.
    """

    def __init__(self, pieces: list[tuple[int, torch.Tensor]], total: int) -> None:
        """``pieces``: (offset, flat uint8 CPU tensor) in payload order, none empty; ``total``: the payload's bytes."""
        self.pieces, self.total = pieces, total
        self._buffers: dict[int, torch.Tensor] = {}

    def chunk(self, index: int, start: int, nbytes: int) -> torch.Tensor:
        """Payload bytes [start, start + nbytes), the ``index``-th chunk sent. A chunk assembled from
        several pieces lives in buffer ``index`` mod _WINDOW, free again once the chunk _WINDOW before
        it was sent (``_stream`` waits for that one before asking for this one)."""
        end = start + nbytes
        for offset, raw in self.pieces:
            if offset <= start and end <= offset + raw.numel():
                return raw[start - offset : end - offset]
        buffer = self._buffers.setdefault(index % _WINDOW, torch.empty(nbytes, dtype=torch.uint8))[:nbytes]
        buffer.zero_()  # the padding between pieces
        for offset, raw in self.pieces:
            lo, hi = max(start, offset), min(end, offset + raw.numel())
            if lo < hi:
                buffer[lo - start : hi - start].copy_(raw[lo - offset : hi - offset])
        return buffer


def lay_out_state(bundle: StateBundle) -> tuple[bytes, LaidOut]:
    """Header JSON bytes and the payload laid out over the bundle's tensors."""
    table, total = _table(bundle.tensors)
    # reshape(-1) first: a 0-d tensor cannot be dtype-viewed; works for bfloat16 without numpy
    raw = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in bundle.tensors.values()]
    payload = LaidOut([(entry["offset"], r) for entry, r in zip(table, raw, strict=True) if r.numel()], total)
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "payload_nbytes": total,
        "checksum": {"algo": CHECKSUM},
        "tensors": table,
        "meta": bundle.meta,
    }
    try:
        return json.dumps(header).encode("utf-8"), payload
    except (TypeError, ValueError) as error:
        raise TypeError(f"StateBundle.meta must be JSON-serializable: {error}") from error


def pack_state(bundle: StateBundle) -> tuple[bytes, torch.Tensor, int]:
    """Header JSON bytes, one flat uint8 payload holding every tensor's raw bytes and its checksum in
    chunks of ``CHUNK_BYTES``: what ``send_state`` streams, as one tensor (``unpack_state`` reads it)."""
    header, laid_out = lay_out_state(bundle)
    payload = laid_out.chunk(0, 0, laid_out.total).clone() if laid_out.total else torch.empty(0, dtype=torch.uint8)
    return header, payload, payload_checksum(payload, CHUNK_BYTES)


def parse_header(header: bytes, template: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Decode the header and check it against the template, before any payload is accepted."""
    try:
        doc = json.loads(header.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise TransferError(f"state header is not valid UTF-8 JSON: {error}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TransferError(f"state header is not a {FORMAT!r} header")
    if doc.get("version") != FORMAT_VERSION:
        raise TransferError(f"state format version {doc.get('version')!r} received, this code reads {FORMAT_VERSION}")
    checksum = doc.get("checksum")
    if not isinstance(checksum, dict) or checksum.get("algo") != CHECKSUM:
        raise TransferError(f"state header names no {CHECKSUM} checksum: {checksum!r}")
    if not isinstance(doc.get("meta"), dict):
        raise TransferError(f"state header meta must be a JSON object, got {type(doc.get('meta')).__name__}")
    expected, total = _table(template)
    _check_table(doc.get("tensors"), expected)
    if doc.get("payload_nbytes") != total:
        raise TransferError(f"header announces {doc.get('payload_nbytes')!r} payload bytes, template implies {total}")
    return doc


def _check_table(got: Any, expected: list[dict[str, Any]]) -> None:
    if not isinstance(got, list) or not all(isinstance(entry, dict) for entry in got):
        raise TransferError("state header field 'tensors' must be a list of objects")
    names = [entry.get("name") for entry in got]
    want = [entry["name"] for entry in expected]
    if names != want:
        raise TransferError(_name_mismatch(names, want))
    for entry, ref in zip(got, expected):
        for key in ("dtype", "shape", "offset", "nbytes"):
            if entry.get(key) != ref[key]:
                raise TransferError(f"tensor {ref['name']!r}: {key} expected {ref[key]}, got {entry.get(key)}")


def _name_mismatch(names: list[Any], want: list[str]) -> str:
    got_set = {n for n in names if isinstance(n, str)}
    missing = [n for n in want if n not in got_set]
    extra = [n for n in names if n not in set(want)]
    if missing or extra:
        return f"tensor names differ from the template: missing {missing}, unexpected {extra}"
    if len(names) != len(want):
        return f"sender sent {len(names)} tensors, template has {len(want)} (duplicate names?)"
    i = next(i for i, (n, w) in enumerate(zip(names, want)) if n != w)
    return f"tensor #{i}: expected {want[i]!r}, got {names[i]!r} (same names in a different order)"


def _check_payload(doc: dict[str, Any], payload: torch.Tensor, want: int, got: int) -> None:
    """``want``: the sender's checksum; ``got``: the payload's, as it arrived."""
    if payload.numel() != doc["payload_nbytes"]:
        raise TransferError(f"payload is {payload.numel()} bytes, header says {doc['payload_nbytes']}")
    if got != want:
        raise TransferError(f"payload checksum mismatch: the sender's {CHECKSUM} {want:#018x}, the bytes' {got:#018x}")


def _split(doc: dict[str, Any], payload: torch.Tensor, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views into the payload with the template's dtypes and shapes (offsets are aligned)."""
    out = {}
    for entry, (name, ref) in zip(doc["tensors"], template.items()):
        raw = payload[entry["offset"] : entry["offset"] + entry["nbytes"]]
        out[name] = raw.view(ref.dtype).view(ref.shape)
    return out


def unpack_state(header: bytes, payload: torch.Tensor, checksum: int, template: dict[str, torch.Tensor]) -> StateBundle:
    """Validate header and payload (its ``checksum`` in chunks of ``CHUNK_BYTES``) against the
    template; the tensors are views of ``payload``."""
    doc = parse_header(header, template)
    _check_payload(doc, payload, checksum, payload_checksum(payload, CHUNK_BYTES))
    return StateBundle(_split(doc, payload, template), doc["meta"])


class _Deadline:
    """One deadline for a whole transfer; turns every Gloo failure (and a cancel) into a TransferError."""

    def __init__(self, timeout_s: float, what: str, cancel: CancelScope | None) -> None:
        self.timeout_s, self.what, self.cancel = timeout_s, what, cancel
        self.end = time.monotonic() + timeout_s

    def post(self, op: Callable[[], dist.Work], step: str) -> dist.Work:
        try:
            return op()
        except RuntimeError as error:  # how Gloo reports a lost peer or a broken lane
            raise TransferError(f"{self.what}: {step}: peer gone or lane broken: {error}") from error

    def wait(self, work: dist.Work, step: str) -> None:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferError(f"{self.what}: {step}: timed out after {self.timeout_s:g} s")
        try:
            wait_work(work, left, self.cancel)
        except LaneError as error:
            if self.cancel is not None and self.cancel.hit():
                raise TransferError(f"{self.what}: {step}: {error}") from error
            expired = self.end - time.monotonic() < 0.05  # Gloo rounds the wait down to whole milliseconds
            why = f"timed out after {self.timeout_s:g} s" if expired else "peer gone"
            raise TransferError(f"{self.what}: {step}: {why}: {error.__cause__ or error}") from error

    def run(self, op: Callable[[], dist.Work], step: str) -> None:
        self.wait(self.post(op, step), step)


def _stream(
    op: Callable[[torch.Tensor], dist.Work],
    slice_of: Callable[[int, int, int], torch.Tensor],
    n: int,
    chunk: int,
    deadline: _Deadline,
    done: Callable[[torch.Tensor], None] = lambda piece: None,
) -> None:
    """Send or receive ``n`` payload bytes in ``chunk``-byte slices (``slice_of(index, start, nbytes)``,
    asked for only once the slice _WINDOW before it is done), at most _WINDOW in flight; ``done`` is
    handed each slice, in order, once its operation completed (while later ones are in flight)."""
    pending = deque()
    count = -(-n // chunk)

    def finish() -> None:
        work, step, piece = pending.popleft()
        deadline.wait(work, step)
        done(piece)

    for i, start in enumerate(range(0, n, chunk)):
        if len(pending) == _WINDOW:
            finish()
        step = f"payload chunk {i + 1}/{count}"
        piece = slice_of(i, start, min(chunk, n - start))
        pending.append((deadline.post(lambda: op(piece), step), step, piece))
    while pending:
        finish()


def _touched(payload: torch.Tensor, index: int, start: int, nbytes: int) -> torch.Tensor:
    """Payload bytes [start, start + nbytes), written once before Gloo receives into them: a receive
    into pages never touched took 8 s for 2.4 GB on loopback, into touched ones 1 s."""
    return payload[start : start + nbytes].zero_()


def _reply(pg: Lane, peer: int, accept: bool, deadline: _Deadline, step: str) -> None:
    verdict = torch.tensor([_ACCEPT if accept else _REFUSE], dtype=torch.int64)
    deadline.run(lambda: pg.send([verdict], peer, _TAG), step)


def _accepted(pg: Lane, peer: int, deadline: _Deadline, step: str) -> bool:
    verdict = torch.zeros(1, dtype=torch.int64)
    deadline.run(lambda: pg.recv([verdict], peer, _TAG), step)
    return int(verdict.item()) == _ACCEPT


def _refuse(pg: Lane, peer: int, deadline: _Deadline, error: TransferError) -> NoReturn:
    """Tell the sender, so it stops at the same message boundary instead of blocking until its timeout."""
    with contextlib.suppress(TransferError):  # the refusal itself is what the caller must hear about
        _reply(pg, peer, False, deadline, "refusal")
    raise TransferError(f"{deadline.what}: {error}") from None


def send_state(pg: Lane, dst: int, bundle: StateBundle, timeout_s: float, cancel: CancelScope | None = None) -> None:
    """Send ``bundle`` to lane rank ``dst`` (the healing peer's side), straight from its tensors;
    returns once the receiver has verified it.

    Raises TransferError if the receiver refuses the header (its template differs) or the
    payload (checksum), if the peer is gone, once ``timeout_s`` has passed in all, or at
    once when ``cancel`` hits it (the receiver left the round, or this group did).
    """
    header, payload = lay_out_state(bundle)
    deadline = _Deadline(timeout_s, f"sending state to lane rank {dst}", cancel)
    chunk = CHUNK_BYTES  # read at call time, so tests can shrink it
    sizes = torch.tensor([len(header), payload.total, chunk], dtype=torch.int64)
    deadline.run(lambda: pg.send([sizes], dst, _TAG), "size prefix")
    header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    deadline.run(lambda: pg.send([header_t], dst, _TAG), "header")
    if not _accepted(pg, dst, deadline, "header verdict"):
        raise TransferError(f"{deadline.what}: the receiver refused the header (its state differs; see its log)")
    sums = ChunkSums()
    _stream(lambda t: pg.send([t], dst, _TAG), payload.chunk, payload.total, chunk, deadline, sums.add)
    deadline.run(lambda: pg.send([sums.tensor()], dst, _TAG), "checksum")
    if not _accepted(pg, dst, deadline, "payload verdict"):
        raise TransferError(f"{deadline.what}: the receiver refused the payload (checksum mismatch on arrival)")


def recv_state(
    pg: Lane,
    src: int,
    template: dict[str, torch.Tensor],
    timeout_s: float,
    max_header_bytes: int = 16 << 20,
    cancel: CancelScope | None = None,
) -> StateBundle:
    """Receive a state from lane rank ``src`` into new staging buffers, checked against ``template``.

    The payload is allocated only after its size and the header match the template, and the
    sender hears every verdict. The returned tensors have the template's dtypes and shapes and
    are views of one staging buffer: the caller copies them into the live state after success.
    """
    deadline = _Deadline(timeout_s, f"receiving state from lane rank {src}", cancel)
    _, total = _table(template)
    sizes = torch.zeros(3, dtype=torch.int64)
    deadline.run(lambda: pg.recv([sizes], src, _TAG), "size prefix")
    header_n, payload_n, chunk = (int(x) for x in sizes.tolist())
    if not 0 < header_n <= max_header_bytes:  # not even the header can be taken: the lane must be rebuilt
        raise TransferError(f"{deadline.what}: header of {header_n} bytes refused (limit {max_header_bytes})")
    header_t = torch.empty(header_n, dtype=torch.uint8)
    deadline.run(lambda: pg.recv([header_t], src, _TAG), "header")
    try:
        doc = parse_header(bytes(byte_view(header_t)), template)  # names the tensor that differs, if any
        if payload_n != total or chunk <= 0:
            raise TransferError(f"sender announced {payload_n} payload bytes in {chunk}-byte chunks, template {total}")
    except TransferError as error:
        _refuse(pg, src, deadline, error)
    _reply(pg, src, True, deadline, "header verdict")
    payload = torch.empty(payload_n, dtype=torch.uint8)
    sums = ChunkSums()  # taken as the chunks arrive, beside the ones still on the wire
    _stream(lambda t: pg.recv([t], src, _TAG), partial(_touched, payload), payload_n, chunk, deadline, sums.add)
    want = torch.zeros(1, dtype=torch.int64)
    deadline.run(lambda: pg.recv([want], src, _TAG), "checksum")
    try:
        _check_payload(doc, payload, int(want.item()) & _MASK, sums.value)
    except TransferError as error:
        _refuse(pg, src, deadline, error)
    _reply(pg, src, True, deadline, "payload verdict")
    return StateBundle(_split(doc, payload, template), doc["meta"])
