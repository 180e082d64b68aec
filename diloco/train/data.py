"""Token streams for training and evaluation, with nothing to download.

The default corpus is the running interpreter's own standard-library sources, so every
machine with the same Python version trains on the same bytes. ``text`` takes any UTF-8
files, ``tokens`` a pre-tokenized binary file that is memory-mapped (it may exceed RAM).

Training batches are a pure function of (seed, group, epoch, read position): each replica
group owns a disjoint shard, and a restarted group resumes from one integer, ``consumed``,
without replaying or skipping windows.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import mmap
import os
import sys
import sysconfig
import warnings
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.config.data import BYTE_VOCAB_SIZE, DataConfig
from diloco.config.job import JobConfig

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_DTYPES = {"uint16": (torch.uint16, 2), "uint32": (torch.uint32, 4)}
_SCAN_CHUNK = 1 << 22  # token ids checked per step, bounding the int64 copy to 32 MiB
_UTF8_CHUNK = 1 << 24  # bytes of text decoded per step when checking a corpus is UTF-8
_WIDTH_SAMPLE = 1 << 16  # token ids checked for a uint32 file read as uint16 (every second one 0)
_WIDTH_MIN_SAMPLE = 64  # fewer ids than this could be 0 at every second place by chance


class DataError(ValueError):
    """A data problem a user can fix; the message names the path, the problem and the fix."""


class ByteTokenizer:
    """UTF-8 bytes as token ids: no vocabulary file, nothing to train or download."""

    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


@dataclass
class TokenSplits:
    """1-D integer token streams; for the tokens corpus, views of one memory map."""

    train: torch.Tensor
    val: torch.Tensor


def load_corpus(cfg: DataConfig) -> TokenSplits:
    """Read the configured corpus and split off its last ``val_fraction`` for evaluation.

    Memoized: a worker forked from the fork server (diloco.launch.forkserver) finds the splits
    the server loaded, shared copy-on-write (or the same read-only memory map), instead of
    spending seconds reading them again. The memo is keyed by the file's identity too, so a
    data file replaced, rewritten or removed since is read again (or reported missing),
    exactly as a fresh process would; for a folder only entries added or removed directly
    in it change its identity. Callers must not write into the returned tensors.
    """
    cfg.validate()
    if cfg.corpus == "stdlib":
        return _load_corpus_cached(cfg, None)  # the running interpreter's sources do not change under it
    try:
        stat = os.stat(str(cfg.path))
    except OSError:
        return read_corpus(cfg)  # raises the DataError that names the path and the fix
    return _load_corpus_cached(cfg, (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)  # a job reads one corpus; a few entries bound what a long test session keeps
def _load_corpus_cached(cfg: DataConfig, identity: tuple[int, ...] | None) -> TokenSplits:
    return read_corpus(cfg)


def read_corpus(cfg: DataConfig) -> TokenSplits:
    """The configured corpus read from disk and split, every call anew (``load_corpus`` memoizes it)."""
    if cfg.corpus == "stdlib":
        stream = _join(_read(p) for p in stdlib_files())
    elif cfg.corpus == "text":
        stream = _load_text(Path(str(cfg.path)))
    else:
        stream = _load_tokens(Path(str(cfg.path)), cfg.token_dtype, cfg.vocab_size)
    # The crc32 file order makes this tail a mix of all files, not the last few alphabetically.
    n_val = int(stream.numel() * cfg.val_fraction)
    n_train = stream.numel() - n_val
    return TokenSplits(train=stream[:n_train], val=stream[n_train:])


def stdlib_files() -> list[Path]:
    """The ``*.py`` files of this interpreter's standard library, in corpus order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    if not found:
        raise DataError(
            f"{root}: this interpreter's standard library has no *.py sources; "
            "use data.corpus=text with data.path=<some text>"
        )
    return _mixed_order(root, found)


def _mixed_order(root: Path, paths: list[Path]) -> list[Path]:
    """Order by crc32 of the relative path, so any slice of the stream samples many files."""

    def key(p: Path) -> tuple[int, str]:
        rel = p.relative_to(root).as_posix()
        return zlib.crc32(os.fsencode(rel)), rel

    return sorted(paths, key=key)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(
            f"{path}: cannot read it ({e.strerror or e}); fix its permissions or "
            "choose other data (data.corpus, data.path)"
        ) from e


def _join(chunks: Iterable[bytes]) -> torch.Tensor:
    """Concatenate files with a newline between them into one uint8 stream (one copy)."""
    buf = bytearray()
    for i, data in enumerate(chunks):
        if i:
            buf += b"\n"
        buf += data
    return torch.frombuffer(buf, dtype=torch.uint8)


def _require_exists(path: Path) -> None:
    try:
        exists = path.exists()
    except OSError as e:
        raise DataError(
            f"{path}: cannot access it ({e.strerror or e}); fix the permissions of "
            "its folders or point data.path elsewhere"
        ) from e
    if not exists:
        raise DataError(f"{path}: no such file or folder (resolved to {path.absolute()}); fix data.path")


def _load_text(path: Path) -> torch.Tensor:
    _require_exists(path)
    if path.is_file():
        data = _read(path)
        if not data:
            raise DataError(f"{path}: the file is empty; point data.path at a file with text")
        if (bad := _first_non_utf8_byte(data)) is not None:
            raise DataError(
                f"{path}: not UTF-8 text (byte {bad} is not valid UTF-8); data.corpus=text takes UTF-8 files: "
                "for a file of token ids use data.corpus=tokens, else convert the file to UTF-8"
            )
        return _join([data])
    if not path.is_dir():
        raise DataError(f"{path}: neither a regular file nor a folder; fix data.path")
    candidates = []
    try:
        for dirpath, dirnames, filenames in os.walk(path, onerror=_raise):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            candidates.extend(Path(dirpath) / n for n in filenames if not n.startswith("."))
    except OSError as e:
        raise DataError(
            f"{e.filename or path}: cannot list it ({e.strerror or e}); fix its "
            "permissions or point data.path elsewhere"
        ) from e
    texts = {p: data for p in candidates if p.is_file() and _is_utf8_text(data := _read(p))}
    if not texts:
        raise DataError(
            f"{path}: the folder holds no non-empty UTF-8 text files (hidden files "
            "are skipped); add some or point data.path elsewhere"
        )
    return _join(texts[p] for p in _mixed_order(path, list(texts)))


def _raise(error: OSError) -> None:
    raise error


def _is_utf8_text(data: bytes) -> bool:
    return len(data) > 0 and _first_non_utf8_byte(data) is None


def _first_non_utf8_byte(data: bytes) -> int | None:
    """The offset of the first byte that is not valid UTF-8, or None; decoded a chunk at a time,
    so checking a corpus of gigabytes never holds it twice (a str is up to 4 bytes a character)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    for start in range(0, len(view), _UTF8_CHUNK):
        held = len(decoder.getstate()[0])  # the start of a character cut by the previous chunk
        try:
            decoder.decode(view[start : start + _UTF8_CHUNK], final=start + _UTF8_CHUNK >= len(view))
        except UnicodeDecodeError as error:
            return start - held + error.start  # error.start counts from the held bytes
    return None


def _load_tokens(path: Path, token_dtype: str, vocab_size: int) -> torch.Tensor:
    dtype, width = _DTYPES[token_dtype]
    _require_exists(path)
    if not path.is_file():
        raise DataError(
            f"{path}: not a regular file; data.corpus=tokens needs a binary file of {token_dtype} token ids"
        )
    if sys.byteorder != "little":
        raise DataError(
            f"{path}: token files are little-endian and this machine is not; convert the file or use data.corpus=text"
        )
    size = path.stat().st_size
    if size == 0 or size % width:
        raise DataError(
            f"{path}: size {size} bytes is not a positive multiple of {width} "
            f"(data.token_dtype={token_dtype}); check data.token_dtype or the file"
        )
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise DataError(
            f"{path}: cannot map it ({e.strerror or e}); fix its permissions or point data.path elsewhere"
        ) from e
    with warnings.catch_warnings():
        # Read-only is the point: the map is shared by all workers and never written.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tokens = torch.frombuffer(mapped, dtype=dtype)
    if token_dtype == "uint16":
        _refuse_wider_ids(path, tokens)
    if vocab_size < 1 << (8 * width):
        _check_ids(path, tokens, vocab_size)
    return tokens


def _refuse_wider_ids(path: Path, tokens: torch.Tensor) -> None:
    """A uint32 file read as uint16 is its ids interleaved with their zero high halves (little-endian):
    every second id 0 over the first ``_WIDTH_SAMPLE`` while the others are not is that, not a corpus."""
    sample = tokens[: _WIDTH_SAMPLE - _WIDTH_SAMPLE % 2].to(torch.int64)
    if sample.numel() >= _WIDTH_MIN_SAMPLE and not sample[1::2].any() and sample[0::2].any():
        raise DataError(
            f"{path}: every second token id of the first {sample.numel():,} is 0, as in a uint32 token file read "
            "with data.token_dtype=uint16; set data.token_dtype=uint32 (the width the file was written with)"
        )


def _check_ids(path: Path, tokens: torch.Tensor, vocab_size: int) -> None:
    for start in range(0, tokens.numel(), _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK].to(torch.int64)
        bad = (chunk >= vocab_size).nonzero()
        if bad.numel():
            at = start + int(bad[0, 0])
            raise DataError(
                f"{path}: token id {int(chunk[bad[0, 0]])} at position {at} is >= "
                f"data.vocab_size={vocab_size}; set data.vocab_size to the "
                "tokenizer's vocabulary size (or check data.token_dtype)"
            )


def shard_windows(train_tokens: int, num_groups: int, seq_len: int) -> int:
    """Training windows in each group's shard: with the seed, what fixes every group's stream."""
    shard_len = train_tokens // num_groups
    return max(shard_len - 1, 0) // seq_len


def data_repeats_warning(job: JobConfig, train_tokens: int) -> str | None:
    """The line a job says at start when its steps read each group's shard of the training split
    more than once (or None): a run that cycles its data measures memorisation, and nothing else
    would show it until the eval loss parts from the train loss."""
    trainer, groups = job.trainer, job.cluster.groups
    step_windows = trainer.batch_size * job.parallel.dp(job.cluster.workers_per_group) * trainer.grad_accum
    shard = shard_windows(train_tokens, groups, trainer.seq_len)
    epochs = trainer.max_steps * step_windows / shard if shard else 0.0
    if epochs <= 1:
        return None
    read = trainer.max_steps * step_windows * trainer.seq_len * groups
    more = "data=text data.path=... or data=tokens" if job.data.corpus == "stdlib" else "a larger corpus at data.path"
    return (
        f"warning: {trainer.max_steps} steps x {groups} groups read {_tokens(read)} tokens, {epochs:.1f} epochs "
        f"of the {_tokens(train_tokens)}-token training split: the data repeats (more data: {more})"
    )


def _tokens(count: int) -> str:
    """``8.2M``, ``640.0k``: a token count at a glance."""
    return f"{count / 1e9:.1f}G" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.1f}k"


def _epoch_seed(seed: int, group: int, epoch: int) -> int:
    """A 63-bit seed per (seed, group, epoch); a hash, so nearby triples do not collide."""
    digest = hashlib.blake2b(f"{seed}/{group}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShardedBatches:
    """A group's training batches: shard ``group`` of the stream, read in per-epoch shuffles.

    A step consumes G = micro_batch_size * num_workers * grad_accum windows of the group's
    sequence; micro-batch a of worker r takes slots [(a*W + r)*B, (a*W + r + 1)*B), so the
    group reads the same windows whatever W and B are, as long as their product is fixed.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        seq_len: int,
        micro_batch_size: int,
        grad_accum: int,
        group: int,
        num_groups: int,
        worker: int,
        num_workers: int,
        seed: int,
    ) -> None:
        for name, value in (
            ("seq_len", seq_len),
            ("micro_batch_size", micro_batch_size),
            ("grad_accum", grad_accum),
            ("num_groups", num_groups),
            ("num_workers", num_workers),
        ):
            if value < 1:
                raise ValueError(f"{name}={value}: must be at least 1")
        if not 0 <= group < num_groups or not 0 <= worker < num_workers:
            raise ValueError(f"group={group}, worker={worker}: must lie in [0, {num_groups}) and [0, {num_workers})")
        self.seq_len, self.micro_batch_size, self.grad_accum = seq_len, micro_batch_size, grad_accum
        self.group, self.worker, self.num_workers, self.seed = group, worker, num_workers, seed
        shard_len = tokens.numel() // num_groups
        self._shard = tokens[group * shard_len : (group + 1) * shard_len]
        self.n_windows = shard_windows(tokens.numel(), num_groups, seq_len)
        self.consumed = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)
        step_windows = self._step_windows
        if self.n_windows < step_windows:
            raise DataError(
                f"group {group}'s shard of the training data holds {shard_len} tokens, but one "
                f"step needs {step_windows} windows of {seq_len}+1 tokens "
                f"({step_windows * seq_len + 1} tokens); use fewer groups (cluster.groups="
                f"{num_groups}), a shorter trainer.seq_len, a smaller batch, or more data"
            )

    @property
    def _step_windows(self) -> int:
        return self.micro_batch_size * self.num_workers * self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        """Tokens the whole group consumes per optimizer step (all workers, all micro-batches)."""
        return self._step_windows * self.seq_len

    def _position(self, index: int) -> int:
        epoch, slot = divmod(index, self.n_windows)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, self.group, epoch))
            self._perm = torch.randperm(self.n_windows, generator=gen)
            self._perm_epoch = epoch
        return int(self._perm[slot])

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This worker's ``grad_accum`` micro-batches of (inputs, targets), each [B, seq_len]."""
        out = []
        b, w = self.micro_batch_size, self.num_workers
        for a in range(self.grad_accum):
            first = self.consumed + (a * w + self.worker) * b
            rows = [self._window(self._position(i)) for i in range(first, first + b)]
            windows = torch.stack(rows)
            out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
        self.consumed += self._step_windows
        return out

    def _window(self, position: int) -> torch.Tensor:
        start = position * self.seq_len
        return self._shard[start : start + self.seq_len + 1].to(torch.int64)

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "n_windows": self.n_windows, "seed": self.seed, "group": self.group}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["consumed"]``; refuse a state that describes another stream."""
        mine = self.state_dict()
        for key in ("n_windows", "seed", "group"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"data state has {key}={state.get(key)!r} but this group has {key}="
                    f"{mine[key]}; resuming would read a different stream; restart with the "
                    "same data, trainer.seq_len, trainer.seed and cluster.groups, or drop the "
                    "state"
                )
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"data state has consumed={consumed!r}; expected a count >= 0")
        self.consumed = consumed


def eval_batches(
    tokens: torch.Tensor, *, seq_len: int, batch_size: int, max_batches: int, worker: int, num_workers: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first validation windows in order, split so each worker gets the same count.

    Batch k of the group is windows [k*B*W, (k+1)*B*W); worker r takes its contiguous B.
    """
    if max_batches < 1:
        raise ValueError(f"max_batches={max_batches}: must be at least 1")
    n_windows = max(tokens.numel() - 1, 0) // seq_len
    per_batch = batch_size * num_workers
    n_batches = min(max_batches, n_windows // per_batch)
    if n_batches < 1:
        raise DataError(
            f"the validation split holds {tokens.numel()} tokens ({n_windows} windows of "
            f"{seq_len}+1), fewer than one batch of {batch_size} windows for each of "
            f"{num_workers} workers; raise data.val_fraction or lower trainer.batch_size / "
            "trainer.seq_len"
        )
    out = []
    for k in range(n_batches):
        first = k * per_batch + worker * batch_size
        windows = torch.stack(
            [tokens[i * seq_len : (i + 1) * seq_len + 1].to(torch.int64) for i in range(first, first + batch_size)]
        )
        out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return out
