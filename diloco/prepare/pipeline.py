"""``role=prepare`` end to end: find the files, choose the tokenizer, tokenize in one or more
processes, lay their ids end to end in ``tokens.bin``, then write ``tokens.json``.

The metadata is written last and any old one removed first, so a tokens.json always describes
the tokens.bin beside it (``data=tokens`` checks the count); a run that fails or is refused
removes what it created in the output (``undone_on_failure``). Memory stays bounded whatever the
corpus's size: each process holds a batch of documents and its ids (one file, for plain text
read whole), and the ids go to disk batch by batch.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue as queue_module
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from diloco.config.prepare import PrepareConfig
from diloco.config.tokens_meta import CorpusMeta, SourceFile, metadata_path, token_dtype_for
from diloco.files import write_text_atomically
from diloco.prepare.shards import ShardCounts, TokenizerSpec, shard_process, split_runs, tokenize_run
from diloco.prepare.sources import Source, documents, find_sources
from diloco.prepare.tokenizer import (
    ChosenTokenizer,
    given_tokenizer,
    save_tokenizer,
    short_vocabulary_line,
    train_bpe,
    vocab_size_of,
)
from diloco.train.data import DataError

TOKENS_FILE = "tokens.bin"
PROGRESS_EVERY_S = 2.0
SHARD_EXIT_WAIT_S = 30.0  # a shard that said it is done exits within this, or something is wrong


def prepare_corpus(cfg: PrepareConfig, say: Callable[[str], None]) -> CorpusMeta:
    """Tokenize ``cfg.input`` into ``cfg.output`` (tokens.bin, tokens.json, tokenizer/); ``say``
    gets the progress lines and the last one. A refused or failed run leaves nothing it created."""
    cfg.check_complete()
    found = find_sources(cfg)
    if found.skipped.total():
        say(f"prepare: reading {len(found.sources):,} files; skipped {found.skipped.summary()}")
    output = Path(str(cfg.output))
    with undone_on_failure(output):
        return _prepare(found.sources, output, cfg, say)


@contextmanager
def undone_on_failure(output: Path) -> Iterator[None]:
    """Make the folder ``output``; if what runs inside fails or is refused (Ctrl-C too), remove what
    this run created: the folder, from the outermost one it made, or in a folder that was there
    only the entries that were not. A folder that held other files keeps them; an empty or
    partial output left behind would look like a corpus to the next command."""
    if output.exists() and not output.is_dir():
        raise DataError(f"prepare.output={output}: is a file; name a folder for tokens.bin")
    made = _outermost_missing(output)
    before = set() if made else set(os.listdir(output))
    output.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if made:
            shutil.rmtree(made, ignore_errors=True)
        else:
            for name in set(os.listdir(output)) - before:
                _remove(output / name)
        raise


def _outermost_missing(path: Path) -> Path | None:
    """The first folder ``path.mkdir(parents=True)`` would make (None: ``path`` exists)."""
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _prepare(sources: list[Source], output: Path, cfg: PrepareConfig, say: Callable[[str], None]) -> CorpusMeta:
    """The tokenizer, the ids and then the metadata, into the folder ``output``."""
    tokens_path = output / TOKENS_FILE
    meta_path = metadata_path(tokens_path)
    meta_path.unlink(missing_ok=True)  # never leave an old tokens.json beside new ids
    info = save_tokenizer(_choose_tokenizer(cfg, sources, say), output)
    spec = TokenizerSpec(output / info.folder / "tokenizer.json", info.eos_id, token_dtype_for(info.vocab_size))
    counts = _tokenize(sources, cfg, spec, tokens_path, say)
    documents_n, tokens_n = sum(c.documents for c in counts), sum(c.tokens for c in counts)
    skipped = sum(c.skipped for c in counts)
    if documents_n == 0:
        tokens_path.unlink(missing_ok=True)
        raise DataError(
            f"prepare.input={cfg.input}: the corpus is empty (no documents"
            + (f"; {skipped} records had a null {cfg.text_field!r}" if skipped else "")
            + "); point it at files with text"
        )
    meta = CorpusMeta(
        tokenizer=info,
        token_dtype=spec.token_dtype,
        documents=documents_n,
        tokens=tokens_n,
        sources=tuple(SourceFile(str(s.path.absolute()), s.bytes) for s in sources),
        text_field=cfg.text_field if any(s.format != "text" for s in sources) else None,
    )
    write_text_atomically(meta_path, json.dumps(meta.to_json(), indent=2) + "\n")
    say(
        f"prepared: {documents_n:,} documents, {tokens_n:,} {spec.token_dtype} tokens (vocabulary "
        f"{info.vocab_size:,}, end of document {info.eos_token!r} = {info.eos_id})"
        + (f", {skipped:,} null records skipped" if skipped else "")
        + f"; train with: python run.py data=tokens data.path={tokens_path}"
    )
    return meta


def _choose_tokenizer(cfg: PrepareConfig, sources: list[Source], say: Callable[[str], None]) -> ChosenTokenizer:
    if cfg.tokenizer:
        return given_tokenizer(cfg.tokenizer, cfg.eos_token)
    say(f"prepare: training a byte-level BPE of {cfg.vocab_size} tokens on the first {cfg.train_mb} MB")
    asked = int(cfg.vocab_size or 0)
    chosen = train_bpe(_texts(sources, cfg), asked, cfg.train_mb)
    corpus_bytes = sum(source.bytes for source in sources)
    if line := short_vocabulary_line(asked, vocab_size_of(chosen.tokenizer), corpus_bytes, cfg.train_mb):
        say(line)
    return chosen


def _tokenize(
    sources: list[Source], cfg: PrepareConfig, spec: TokenizerSpec, tokens_path: Path, say: Callable[[str], None]
) -> list[ShardCounts]:
    """Every source into ``tokens_path``, in ``cfg.workers`` runs of files (one: in this process)."""
    runs = split_runs(sources, cfg.workers)
    parts = [tokens_path.with_name(f".{tokens_path.name}.part{k}") for k in range(len(runs))]
    progress = Progress(sources, say, len(runs))
    try:
        if len(runs) == 1:
            counts = [tokenize_run(runs[0], cfg, spec, parts[0], lambda c: progress.update(0, c))]
        else:
            counts = _run_processes(runs, cfg, spec, parts, progress)
        _join_parts(parts, tokens_path)
    finally:
        for part in parts:
            part.unlink(missing_ok=True)
    progress.finish(counts)
    return counts


def _texts(sources: list[Source], cfg: PrepareConfig) -> Iterator[str]:
    """Every document's text in corpus order (for BPE training, which stops reading when it has enough)."""
    for source in sources:
        for texts in documents(source, cfg):
            yield from (t for t in texts if t is not None)


def _run_processes(
    runs: list[list[Source]], cfg: PrepareConfig, spec: TokenizerSpec, parts: list[Path], progress: Progress
) -> list[ShardCounts]:
    """One spawned process per run (spawn: the parent has started pyarrow's and tokenizers' threads,
    which a fork would copy mid-flight); their counts arrive on a queue."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    processes = [
        context.Process(target=shard_process, args=(k, run, cfg, spec, parts[k], messages), daemon=True)
        for k, run in enumerate(runs)
    ]
    for process in processes:
        process.start()
    done: dict[int, ShardCounts] = {}
    try:
        while len(done) < len(processes):
            try:
                kind, index, payload = messages.get(timeout=1.0)
            except queue_module.Empty:
                if dead := [k for k, p in enumerate(processes) if k not in done and p.exitcode not in (None, 0)]:
                    code = processes[dead[0]].exitcode
                    raise RuntimeError(
                        f"prepare: shard process {dead[0]} died (exit code {code}); see its traceback above"
                    )
                continue
            if kind == "error":
                raise DataError(payload)
            progress.update(index, payload)
            if kind == "done":
                done[index] = payload
        for process in processes:
            process.join(SHARD_EXIT_WAIT_S)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
    return [done[k] for k in range(len(processes))]


def _join_parts(parts: list[Path], tokens_path: Path) -> None:
    """The shards' ids end to end in ``tokens_path`` (one shard: renamed, no copy)."""
    if len(parts) == 1:
        os.replace(parts[0], tokens_path)
        return
    joined = tokens_path.with_name(f".{tokens_path.name}.joining")
    with joined.open("wb") as out:
        for part in parts:
            with part.open("rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 24)
    os.replace(joined, tokens_path)


class Progress:
    """The progress line: a bar over the input's bytes, documents and tokens, and their rates."""

    def __init__(self, sources: list[Source], say: Callable[[str], None], shards: int) -> None:
        self.total_bytes = sum(s.bytes for s in sources)
        self.files = len(sources)
        self.say = say
        self.start = time.monotonic()
        self.last = self.start
        self.counts = [ShardCounts() for _ in range(shards)]

    def update(self, shard: int, counts: ShardCounts) -> None:
        self.counts[shard] = counts
        if (now := time.monotonic()) - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.say(self.line(now - self.start))

    def finish(self, counts: list[ShardCounts]) -> None:
        self.counts = counts
        self.say(self.line(time.monotonic() - self.start))

    def line(self, elapsed_s: float) -> str:
        c = self.counts
        done_bytes = sum(x.file_bytes_done + x.text_bytes for x in c)
        return render_prepare_progress(
            done_bytes,
            self.total_bytes,
            sum(x.files_done for x in c),
            self.files,
            sum(x.documents for x in c),
            sum(x.tokens for x in c),
            elapsed_s,
        )


def render_prepare_progress(
    done_bytes: int,
    total_bytes: int,
    files_done: int,
    files: int,
    docs: int,
    tokens: int,
    elapsed_s: float,
    width: int = 24,
) -> str:
    """The progress line, a bar over the input's bytes (the time left assumes the rate so far):
    ``prepare [##########....] 41% 3/10 files 12,340 docs 4.5M tokens | 1,234 docs/s 450.0k tok/s 0:10<0:14``."""
    frac = min(1.0, done_bytes / total_bytes) if total_bytes else 1.0
    filled = int(round(frac * width))
    seconds = elapsed_s if elapsed_s > 0 else float("inf")  # no rate before any time has passed
    eta = _duration(elapsed_s * (1 - frac) / frac) if frac > 0 else "?"
    return (
        f"prepare [{'#' * filled}{'.' * (width - filled)}] {100 * frac:.0f}% {files_done}/{files} files "
        f"{docs:,} docs {tokens / 1e6:.1f}M tokens | {docs / seconds:,.0f} docs/s {tokens / seconds / 1000:.1f}k tok/s "
        f"{_duration(elapsed_s)}<{eta}"
    )


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60:d}:{seconds % 60:02d}"
