"""One process's share of ``role=prepare``: a contiguous run of input files tokenized in batches
into a little-endian token file, the end-of-document id after every document.

A run of files, not interleaved documents, so the shards' files laid end to end are exactly the
ids one process would write: the number of processes never changes the token file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco.config.prepare import PrepareConfig
from diloco.prepare.sources import Source, documents
from diloco.train.data import DataError

NUMPY_DTYPES = {"uint16": "<u2", "uint32": "<u4"}  # little-endian on every machine, as data=tokens reads them
REPORT_EVERY_S = 0.5  # how often a shard process tells the parent its counts
# Characters per encode_batch call. Its Encodings cost ~100 bytes a token (ids, masks, token
# strings) until dropped: a batch of 1,000 whole source files held ~600 MB, a 1M-character chunk
# holds tens of MB, and still gives the tokenizer's threads dozens of documents to share.
ENCODE_CHARS = 1 << 20


@dataclass(frozen=True)
class TokenizerSpec:
    """What every shard needs to write the same ids: the saved tokenizer, the end-of-document id, the width."""

    file: Path
    eos_id: int
    token_dtype: str


@dataclass
class ShardCounts:
    """What a shard has done so far; ``text_bytes`` (UTF-8 characters read, roughly) drives the progress bar."""

    documents: int = 0
    tokens: int = 0
    skipped: int = 0  # records whose text field was null
    text_bytes: int = 0
    files_done: int = 0
    file_bytes_done: int = 0


def split_runs(sources: list[Source], parts: int) -> list[list[Source]]:
    """``sources`` cut into at most ``parts`` contiguous, non-empty runs of about equal bytes."""
    total = sum(s.bytes for s in sources)
    runs: list[list[Source]] = [[]]
    seen = 0
    for source in sources:
        # a new run starts where this file's middle passes the current run's share of the bytes
        if runs[-1] and len(runs) < parts and seen + source.bytes / 2 > total * len(runs) / parts:
            runs.append([])
        runs[-1].append(source)
        seen += source.bytes
    return runs


def encode_chunks(texts: list[str], limit: int) -> Iterator[list[str]]:
    """``texts`` in order, in runs of at most ``limit`` characters (a longer document alone)."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        if chunk and size + len(text) > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(text)
        size += len(text)
    if chunk:
        yield chunk


def tokenize_run(
    run: list[Source], cfg: PrepareConfig, spec: TokenizerSpec, out: Path, report: Callable[[ShardCounts], None]
) -> ShardCounts:
    """Tokenize ``run`` into ``out``; ``report`` gets the counts after every chunk."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(spec.file))
    dtype, eos_id = NUMPY_DTYPES[spec.token_dtype], spec.eos_id
    counts = ShardCounts()
    with out.open("wb") as fh:
        for source in run:
            for texts in documents(source, cfg):
                kept = [t for t in texts if t is not None]
                counts.skipped += len(texts) - len(kept)
                for chunk in encode_chunks(kept, ENCODE_CHARS):
                    ids: list[int] = []
                    for encoding in tokenizer.encode_batch_fast(chunk, add_special_tokens=False):
                        ids += encoding.ids
                        ids.append(eos_id)
                    np.asarray(ids, dtype=dtype).tofile(fh)
                    counts.documents += len(chunk)
                    counts.tokens += len(ids)
                    counts.text_bytes += sum(map(len, chunk))
                    report(counts)
            counts.files_done += 1
            counts.file_bytes_done += source.bytes
            counts.text_bytes = 0  # the bar counts a finished file by its size on disk
            report(counts)
    return counts


def shard_process(
    index: int, run: list[Source], cfg: PrepareConfig, spec: TokenizerSpec, out: Path, queue: Any
) -> None:
    """Entry point of a shard process (spawned): tokenize, telling the parent its counts on ``queue``
    as ``("counts", index, ShardCounts)``; a data problem goes back as ``("error", index, message)``."""
    last = 0.0

    def report(counts: ShardCounts) -> None:
        nonlocal last
        if (now := time.monotonic()) - last >= REPORT_EVERY_S:
            last = now
            queue.put(("counts", index, counts))

    try:
        counts = tokenize_run(run, cfg, spec, out, report)
    except DataError as error:
        queue.put(("error", index, str(error)))
        return
    queue.put(("done", index, counts))
