"""Throughput and peak memory of ``role=prepare`` on a corpus of a few hundred MB.

Makes a JSONL corpus of repeated standard-library sources in a temporary folder (``--files``
files, so ``prepare.workers`` has files to share), trains a byte-level BPE on 200 of its documents once,
then tokenizes the whole corpus with that tokenizer for each ``--workers`` count, timing the
``python run.py role=prepare`` command and sampling the resident memory of its process tree
(the command and its shard processes, from /proc) every 0.1 s:

    python -m experiments.parallelism.bench_prepare --mb 300 --workers 1,2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from diloco.train.data import stdlib_files

REPO = Path(__file__).resolve().parents[2]
SAMPLE_EVERY_S = 0.1


@dataclass
class Measured:
    workers: int
    corpus_mb: float
    documents: int
    tokens: int
    wall_s: float
    peak_rss_mb: float


def make_corpus(folder: Path, mb: int, files: int) -> float:
    """``files`` JSONL files of about ``mb / files`` MB each, the stdlib's sources over and over; the MB written."""
    records = [json.dumps({"text": p.read_text(errors="replace")}) + "\n" for p in stdlib_files()]
    per_file = (mb << 20) // files
    written = 0
    for k in range(files):
        size = 0
        with (folder / f"part{k:03d}.jsonl").open("w") as fh:
            while size < per_file:
                for record in records[k::files]:  # each file starts elsewhere in the stdlib
                    fh.write(record)
                    size += len(record)
                    if size >= per_file:
                        break
        written += size
    return written / (1 << 20)


def tree_rss_mb(root: int) -> float:
    """Resident memory of ``root`` and every descendant, from /proc (Linux), in MB."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            rss[int(entry.name)] = int(fields[21]) * 4096  # field 24 of stat: resident pages
            children.setdefault(int(fields[1]), []).append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total / (1 << 20)


def run_prepare(options: list[str]) -> tuple[float, float, str]:
    """Run ``python run.py role=prepare *options``: (wall s, peak tree RSS MB, stdout)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "run.py", "role=prepare", *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, tree_rss_mb(proc.pid))
        time.sleep(SAMPLE_EVERY_S)
    out = proc.stdout.read()
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"role=prepare failed ({proc.returncode}):\n{out}")
    return wall, peak, out


def table(rows: list[Measured]) -> str:
    """The results as a markdown table (docs/results/parallelism.md keeps it beside the command)."""
    lines = [
        "| workers | corpus MB | documents | tokens | wall s | tokens/s | documents/s | MB/s | peak RSS MB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.workers} | {r.corpus_mb:.0f} | {r.documents:,} | {r.tokens:,} | {r.wall_s:.1f} | "
            f"{r.tokens / r.wall_s:,.0f} | {r.documents / r.wall_s:,.0f} | {r.corpus_mb / r.wall_s:.2f} | "
            f"{r.peak_rss_mb:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="corpus size in MB")
    parser.add_argument("--files", type=int, default=8, help="JSONL files the corpus is split into")
    parser.add_argument("--workers", default="1,2", help="prepare.workers values to measure, comma-separated")
    parser.add_argument("--vocab-size", type=int, default=8192, help="the BPE trained once on 200 documents")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        corpus_mb = make_corpus(root / "corpus", args.mb, args.files)
        print(f"corpus: {corpus_mb:.0f} MB of JSONL in {args.files} files")
        sample = root / "bpe_sample.jsonl"  # the BPE is trained (and this slice tokenized) once, untimed
        with (root / "corpus" / "part000.jsonl").open() as fh:
            sample.write_text("".join(fh.readline() for _ in range(200)))
        _, _, out = run_prepare(
            [
                f"prepare.input={sample}",
                f"prepare.output={root / 'bpe'}",
                f"prepare.vocab_size={args.vocab_size}",
                "prepare.train_mb=1",
                f"hydra.run.dir={root / 'runs' / 'bpe'}",
            ]
        )
        tokenizer = root / "bpe" / "tokenizer" / "tokenizer.json"
        rows = []
        for workers in map(int, args.workers.split(",")):
            out_dir = root / f"out{workers}"
            wall, peak, out = run_prepare(
                [
                    f"prepare.input={root / 'corpus'}",
                    f"prepare.output={out_dir}",
                    f"prepare.tokenizer={tokenizer}",
                    f"prepare.workers={workers}",
                    f"hydra.run.dir={root / 'runs' / str(workers)}",
                ]
            )
            meta = json.loads((out_dir / "tokens.json").read_text())
            rows.append(Measured(workers, corpus_mb, meta["documents"], meta["tokens"], wall, peak))
            print(out.strip().splitlines()[-2])  # the last progress line: the rates without start-up
            (out_dir / "tokens.bin").unlink()  # keep the temporary folder's disk use to one token file
        print(table(rows))


if __name__ == "__main__":
    main()
