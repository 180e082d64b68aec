"""role=prepare: a corpus of text, JSONL or Parquet tokenized into the token file data=tokens reads.

The fast tests need neither ``datasets`` nor ``tokenizers``; the slow ones read real files with
both (the first read in a process costs ~4 s of imports) and one trains and samples end to end.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from diloco.config.base import ConfigError
from diloco.config.prepare import PrepareConfig
from diloco.config.tokens_meta import metadata_path
from diloco.launch.inference import evaluate_checkpoint, locate_weights
from diloco.launch.roles import trained_job_config
from diloco.prepare.pipeline import prepare_corpus, render_prepare_progress, undone_on_failure
from diloco.prepare.selection import glob_regex, matches, not_text
from diloco.prepare.shards import encode_chunks, split_runs
from diloco.prepare.sources import Source, find_sources, format_of
from diloco.prepare.tokenizer import short_vocabulary_line
from diloco.train.corpus_meta import load_tokenizer, read_corpus_meta, tokenizer_folder
from diloco.train.data import DataError, load_corpus, stdlib_files
from tests.conftest import REPO, compose_job


def test_files_are_split_into_contiguous_runs_of_about_equal_bytes():
    sources = [Source(Path(f"f{i}"), size, "text") for i, size in enumerate([5, 5, 5, 5, 40, 1, 1])]
    runs = split_runs(sources, 3)
    assert [s for run in runs for s in run] == sources  # in order: the runs laid end to end are the corpus
    assert [len(run) for run in runs] == [4, 1, 2]
    assert split_runs(sources[:2], 8) == [[sources[0]], [sources[1]]]  # never an empty run
    assert split_runs(sources, 1) == [sources]


def test_documents_are_encoded_in_order_in_chunks_of_bounded_characters():
    texts = ["aaaa", "bb", "c", "dddddddd", "e"]
    assert list(encode_chunks(texts, 6)) == [["aaaa", "bb"], ["c"], ["dddddddd"], ["e"]]
    assert list(encode_chunks([], 6)) == []


def test_the_progress_line_shows_the_bar_counts_and_rates():
    line = render_prepare_progress(41, 100, 3, 10, 12_340, 4_500_000, 10.0)
    assert line == (
        "prepare [##########..............] 41% 3/10 files 12,340 docs 4.5M tokens | "
        "1,234 docs/s 450.0k tok/s 0:10<0:14"
    )
    assert "0:00<?" in render_prepare_progress(0, 100, 0, 1, 0, 0, 0.0)


def test_formats_come_from_the_suffix_through_compression():
    names = {"a.jsonl": "jsonl", "b.json.gz": "jsonl", "c.parquet": "parquet", "d.txt": "text", "e.py": "text"}
    assert {name: format_of(Path(name)) for name in names} == names


def test_the_input_is_every_visible_file_in_order_but_the_output_folder(tmp_path):
    for name in ("b.txt", "a/z.jsonl", "a/y.parquet", ".git/x.txt", "prep/tokens.bin"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "a" / "y.parquet").write_bytes(b"PAR1\0\x15\xff")  # binary, but typed by its suffix: never sniffed
    found = find_sources(PrepareConfig(input=str(tmp_path), output=str(tmp_path / "prep")))
    assert [(s.path.relative_to(tmp_path).as_posix(), s.format) for s in found.sources] == [
        ("a/y.parquet", "parquet"),
        ("a/z.jsonl", "jsonl"),
        ("b.txt", "text"),
    ]
    assert found.skipped.summary() == "1 hidden (.git)"


PNG_HEAD = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x10"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("plain ascii\n".encode(), None),
        (("é" * 5000).encode(), None),  # 10,000 bytes: the 8 KB edge cuts a character in two, still text
        (PNG_HEAD, "a NUL byte in its first 8 KB"),
        ("café".encode("latin-1"), "not UTF-8 in its first 8 KB (byte 3)"),
        (b"x" * (8 << 10) + b"\0", None),  # past the first 8 KB: not looked at
    ],
    ids=["ascii", "utf-8 cut at the edge", "png", "latin-1", "nul past 8 KB"],
)
def test_a_file_is_text_by_its_first_8_kb(tmp_path, content, why):
    (tmp_path / "f").write_bytes(content)
    assert not_text(tmp_path / "f") == why


def test_a_compressed_file_is_text_by_what_it_holds(tmp_path):
    import gzip

    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"text inside"))
    (tmp_path / "b.gz").write_bytes(gzip.compress(PNG_HEAD))
    (tmp_path / "c.gz").write_bytes(b"not gzip at all")
    assert not_text(tmp_path / "a.txt.gz") is None
    assert not_text(tmp_path / "b.gz") == "a NUL byte in its first 8 KB"
    assert not_text(tmp_path / "c.gz") == "cannot be read (BadGzipFile)"


@pytest.mark.parametrize(
    ("pattern", "hits", "misses"),
    [
        ("**/*.py", ["a.py", "src/a.py", "src/x/a.py"], ["a.pyc", "py/a.txt"]),
        ("*.png", ["logo.png", "docs/img/logo.png"], ["logo.png.txt"]),  # no /: a name at any depth
        ("docs/**", ["docs/a.md", "docs/x/y.md"], ["mydocs/a.md", "src/docs.md"]),
        ("docs", ["docs/a.md", "src/docs/x.md", "docs"], ["docs.md"]),  # a folder: every file under it
        ("src/*.py", ["src/a.py"], ["src/x/a.py", "a.py", "lib/src/a.py"]),  # with /: from prepare.input down
        ("data/?.[ct]sv", ["data/a.csv", "data/b.tsv"], ["data/ab.csv", "data/a.xsv"]),
        ("[!_]*.py", ["a.py"], ["_private.py"]),
    ],
)
def test_include_and_exclude_globs_match_paths_relative_to_the_input(pattern, hits, misses):
    glob = [glob_regex(pattern)]
    assert [path for path in hits + misses if matches(path, glob)] == hits


def test_a_folders_files_are_picked_by_include_exclude_and_hidden(tmp_path):
    for name in ("README.md", "src/a.py", "src/b.py", "src/gen/c.py", "docs/d.md", ".github/ci.yml", "empty.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("" if name == "empty.py" else "x")

    def picked(**keys):
        found = find_sources(PrepareConfig(input=str(tmp_path), output=str(tmp_path / "out"), **keys))
        return [s.path.relative_to(tmp_path).as_posix() for s in found.sources], found.skipped.summary()

    assert picked(include=("**/*.py",), exclude=("src/gen",)) == (
        ["src/a.py", "src/b.py"],
        "2 not matching prepare.include, 1 matching prepare.exclude, 1 empty, 1 hidden (.github)",
    )
    assert picked(exclude=("*.py",), hidden=True) == (
        [".github/ci.yml", "README.md", "docs/d.md"],
        "4 matching prepare.exclude",
    )


def test_bad_include_and_exclude_globs_name_the_key():
    with pytest.raises(
        ConfigError, match=r"^prepare.exclude=\['\*.log', '/build'\]: '/build' starts with /, .*; drop the /$"
    ):
        PrepareConfig(exclude=("*.log", "/build")).validate()
    with pytest.raises(ConfigError, match=r"^prepare.include=\['../x'\]: '../x' has a .. part"):
        PrepareConfig(include=("../x",)).validate()
    with pytest.raises(ConfigError, match=r"^prepare.include=\[''\]: holds an empty pattern; remove it$"):
        PrepareConfig(include=("",)).validate()
    assert compose_job(["role=prepare", "prepare.include=[**/*.py,docs/**]"]).prepare.include == ("**/*.py", "docs/**")


def test_the_benchmark_table_has_a_row_per_run_with_its_rates():
    from experiments.parallelism.bench_prepare import Measured, table

    lines = table(
        [Measured(workers=2, corpus_mb=300.0, documents=1000, tokens=5_000_000, wall_s=10.0, peak_rss_mb=700.4)]
    )
    assert lines.splitlines()[2] == "| 2 | 300 | 1,000 | 5,000,000 | 10.0 | 500,000 | 100 | 30.00 | 700 |"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "nowhere", r"prepare.input=.*nowhere: no such file or folder .*; fix the path"),
        (lambda d: d, r"prepare.input=.*: the corpus is empty .*; point it at text, JSONL or Parquet files"),
        (lambda d: (d / "empty.jsonl").touch() or d / "empty.jsonl", r"the corpus is empty"),
    ],
    ids=["missing path", "empty folder", "empty file"],
)
def test_a_missing_or_empty_input_is_refused_in_one_line(tmp_path, make, message):
    cfg = PrepareConfig(input=str(make(tmp_path)), output=str(tmp_path / "out"), vocab_size=300)
    with pytest.raises(DataError, match=message) as refused:
        prepare_corpus(cfg, print)
    assert "\n" not in str(refused.value)


def test_a_folder_with_no_text_file_left_is_refused_naming_what_was_skipped_and_the_keys(tmp_path):
    (tmp_path / "in" / ".git").mkdir(parents=True)
    (tmp_path / "in" / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (tmp_path / "in" / "logo.png").write_bytes(PNG_HEAD)
    (tmp_path / "in" / "notes.md").write_text("notes")
    cfg = PrepareConfig(input=str(tmp_path / "in"), output=str(tmp_path / "out"), vocab_size=300, exclude=("*.md",))
    with pytest.raises(DataError) as refused:
        prepare_corpus(cfg, print)
    assert str(refused.value) == (
        f"prepare.input={tmp_path / 'in'}: the corpus is empty (skipped 1 not text (NUL or not UTF-8 in the "
        "first 8 KB: logo.png), 1 matching prepare.exclude, 1 hidden (.git)); point it at text, JSONL or "
        "Parquet files, or change prepare.exclude or prepare.hidden"
    )
    assert not (tmp_path / "out").exists()


def test_a_file_named_as_the_input_is_refused_if_it_is_not_text_or_given_folder_keys(tmp_path):
    (tmp_path / "logo.png").write_bytes(PNG_HEAD)
    cfg = PrepareConfig(input=str(tmp_path / "logo.png"), output=str(tmp_path / "out"), vocab_size=300)
    with pytest.raises(DataError, match=r"logo.png: not text \(a NUL byte in its first 8 KB\); point it at text"):
        prepare_corpus(cfg, print)
    (tmp_path / "a.txt").write_text("text")
    cfg = PrepareConfig(input=str(tmp_path / "a.txt"), output=str(tmp_path / "out"), vocab_size=300, hidden=True)
    with pytest.raises(DataError, match=r"^prepare.hidden picks a folder's files, but prepare.input=.*a.txt is a file"):
        prepare_corpus(cfg, print)
    assert not (tmp_path / "out").exists()


def test_a_failed_run_removes_only_what_it_created_in_the_output(tmp_path):
    with pytest.raises(KeyboardInterrupt), undone_on_failure(tmp_path / "new" / "deeper" / "out"):
        (tmp_path / "new" / "deeper" / "out" / "tokens.bin").write_bytes(b"\0\0")
        raise KeyboardInterrupt
    assert not (tmp_path / "new").exists()  # from the outermost folder the run made

    kept = tmp_path / "kept"
    (kept / "tokenizer").mkdir(parents=True)
    (kept / "notes.txt").write_text("the user's")
    with pytest.raises(DataError), undone_on_failure(kept):
        (kept / "tokens.bin").write_bytes(b"\0\0")
        (kept / "new_folder").mkdir()
        raise DataError("refused")
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt", "tokenizer"]

    with undone_on_failure(tmp_path / "fine"):
        (tmp_path / "fine" / "tokens.bin").write_bytes(b"\0\0")
    assert (tmp_path / "fine" / "tokens.bin").exists()


def test_a_run_refused_after_making_the_output_leaves_no_folder(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    cfg = PrepareConfig(input=str(tmp_path / "a.txt"), output=str(tmp_path / "out"), tokenizer=str(tmp_path / "no"))
    with pytest.raises(DataError, match=r"prepare.tokenizer=.*no: no such file or folder"):
        prepare_corpus(cfg, print)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (PrepareConfig(output="o", vocab_size=300), r"prepare.input=None: required"),
        (PrepareConfig(input="i", vocab_size=300), r"prepare.output=None: required"),
        (PrepareConfig(input="i", output="o"), r"prepare.tokenizer=None: required .* or set prepare.vocab_size=N"),
    ],
)
def test_prepare_needs_an_input_an_output_and_a_tokenizer(cfg, message):
    with pytest.raises(ConfigError, match=message):
        prepare_corpus(cfg, print)


def test_bad_prepare_values_name_the_key():
    with pytest.raises(ConfigError, match=r"prepare.vocab_size=100: must be at least 257"):
        PrepareConfig(vocab_size=100).validate()
    with pytest.raises(ConfigError, match=r"prepare.vocab_size=300: trains a tokenizer, but prepare.tokenizer=t.json"):
        PrepareConfig(vocab_size=300, tokenizer="t.json").validate()


def test_a_trained_vocabulary_smaller_than_asked_is_said_with_why():
    assert short_vocabulary_line(8192, 4328, 1_234_567, 256) == (
        "prepare: the trained vocabulary holds 4,328 tokens, not the 8,192 asked: the corpus (1,234,567 bytes) "
        "is too small to have that many merges; tokens.json records 4,328 and the model follows it"
    )
    assert "the first 1 MB read for training (prepare.train_mb) have no more pairs" in short_vocabulary_line(
        8192, 4328, 5 << 20, 1
    )
    assert short_vocabulary_line(8192, 8192, 1_234_567, 256) is None


# --- slow: real files through datasets and tokenizers ---------------------------------------------


@pytest.mark.slow  # datasets' first read (~2 s of imports)
def test_prepare_says_when_the_corpus_is_too_small_for_the_vocabulary_asked(tmp_path):
    (tmp_path / "in.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)  # 900 bytes
    said = []
    cfg = PrepareConfig(input=str(tmp_path / "in.txt"), output=str(tmp_path / "out"), vocab_size=2000)
    meta = prepare_corpus(cfg, said.append)
    assert meta.tokenizer.vocab_size < 2000
    assert (
        f"prepare: the trained vocabulary holds {meta.tokenizer.vocab_size:,} tokens, not the 2,000 asked: the "
        "corpus (900 bytes) is too small to have that many merges; tokens.json records "
        f"{meta.tokenizer.vocab_size:,} and the model follows it"
    ) in said


def small_tokenizer(folder: Path) -> Path:
    """A byte-level BPE of a few hundred tokens, trained here on a few stdlib files: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([p.read_text() for p in stdlib_files()[:5]], trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def documents_of(output: Path) -> list[str]:
    """The prepared ids cut at the end-of-document id and decoded: the documents that went in."""
    meta = read_corpus_meta(data_cfg(output))
    tokenizer = load_tokenizer(data_cfg(output))
    ids = np.fromfile(output / "tokens.bin", dtype="<u2" if meta.token_dtype == "uint16" else "<u4").tolist()
    assert ids[-1] == meta.tokenizer.eos_id and len(ids) == meta.tokens
    docs, start = [], 0
    for i, token in enumerate(ids):
        if token == meta.tokenizer.eos_id:
            docs.append(tokenizer.decode(ids[start:i]))
            start = i + 1
    return docs


def data_cfg(output: Path):
    return compose_job(["data=tokens", f"data.path={output / 'tokens.bin'}"]).data


@pytest.mark.slow
def test_parquet_and_plain_text_prepare_into_the_documents_they_hold(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = small_tokenizer(tmp_path / "tok")
    texts = ["def f(x):\n    return x\n", "héllo wörld", "", "class A:\n    pass\n"]
    pq.write_table(pa.table({"content": texts, "n": [1, 2, 3, 4]}), tmp_path / "corpus.parquet")
    out = tmp_path / "from_parquet"
    cfg = PrepareConfig(
        input=str(tmp_path / "corpus.parquet"), output=str(out), tokenizer=str(tokenizer), text_field="content"
    )
    meta = prepare_corpus(cfg, lambda line: None)
    assert documents_of(out) == texts and meta.documents == 4 and meta.text_field == "content"
    assert meta.tokenizer.eos_token == "</s>" and meta.tokenizer.vocab_size == 300 and meta.token_dtype == "uint16"
    assert meta.sources[0].bytes == (tmp_path / "corpus.parquet").stat().st_size

    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second file\nline two\n")
    (folder / "sub" / "a.md").write_text("third")
    (folder / ".hidden.txt").write_text("skipped")
    for unit, expected in (
        ("file", ["second file\nline two\n", "third"]),
        ("line", ["second file", "line two", "third"]),
    ):
        cfg = PrepareConfig(input=str(folder), output=str(tmp_path / unit), tokenizer=str(tokenizer), text_unit=unit)
        meta = prepare_corpus(cfg, lambda line: None)
        assert documents_of(tmp_path / unit) == expected and meta.text_field is None
        assert [Path(s.path).name for s in meta.sources] == ["b.txt", "a.md"]


@pytest.mark.slow
def test_a_repository_like_folder_prepares_its_text_and_says_what_it_skipped(tmp_path):
    repo = tmp_path / "repo"
    files = {
        "README.md": b"# demo\n",
        "src/main.py": b"def main():\n    return 0\n",
        "docs/logo.png": PNG_HEAD + bytes(range(256)),
        "docs/guide.txt": "guide, é\n".encode(),
        "build/run.log": b"built\n",
        ".git/HEAD": b"ref: refs/heads/main\n",
        ".git/objects/ab/cdef": b"x\x9c\0\x01",
    }
    for name, content in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(content)
    said = []
    cfg = PrepareConfig(
        input=str(repo),
        output=str(tmp_path / "out"),
        tokenizer=str(small_tokenizer(tmp_path / "tok")),
        exclude=("*.log",),
    )
    meta = prepare_corpus(cfg, said.append)
    assert [Path(s.path).relative_to(repo).as_posix() for s in meta.sources] == [
        "README.md",
        "docs/guide.txt",
        "src/main.py",
    ]
    assert documents_of(tmp_path / "out") == ["# demo\n", "guide, é\n", "def main():\n    return 0\n"]
    assert said[0] == (
        "prepare: reading 3 files; skipped 1 not text (NUL or not UTF-8 in the first 8 KB: docs/logo.png), "
        "1 matching prepare.exclude, 1 hidden (.git)"
    )
    assert said[-1].startswith("prepared: 3 documents")


@pytest.mark.slow
def test_a_transformers_tokenizer_directory_is_used_with_its_eos_and_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    file = small_tokenizer(tmp_path / "tok")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(file)), eos_token="</s>")
    fast.save_pretrained(tmp_path / "hf")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b", "c"]))
    out = tmp_path / "out"
    cfg = PrepareConfig(input=str(tmp_path / "c.jsonl"), output=str(out), tokenizer=str(tmp_path / "hf"))
    meta = prepare_corpus(cfg, lambda line: None)
    assert meta.tokenizer.eos_token == "</s>" and meta.tokenizer.eos_id == fast.eos_token_id
    assert meta.tokenizer.source == str((tmp_path / "hf").absolute())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tokenizer_folder(data_cfg(out)).iterdir()}
    assert documents_of(out) == ["a b", "c"]
    assert load_tokenizer(data_cfg(out)).encode("a b").tolist() == fast.encode("a b", add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_corpus_without_the_text_field_is_refused_in_one_line(tmp_path, kind):
    if kind == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_text(json.dumps({"body": "x"}) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "c.parquet"
        pq.write_table(pa.table({"body": ["x"]}), path)
    what = "field" if kind == "jsonl" else "column"
    cfg = PrepareConfig(input=str(path), output=str(tmp_path / "o"), tokenizer=str(small_tokenizer(tmp_path / "t")))
    with pytest.raises(
        DataError, match=rf"c.{kind}: its records have no {what} 'text' \(they have: body\); set prepare.text_field"
    ) as refused:
        prepare_corpus(cfg, lambda line: None)
    assert "\n" not in str(refused.value)
    assert not metadata_path(tmp_path / "o" / "tokens.bin").exists()
    assert not (tmp_path / "o").exists()  # refused while tokenizing: the folder it made is gone too


@pytest.mark.slow
def test_prepare_a_stdlib_corpus_train_on_it_with_diloco_and_sample_text(tmp_path):
    """The whole path: a BPE trained on the standard library's sources, a JSONL corpus of them
    prepared by two processes (the same ids one process writes), a DiLoCo job (2 groups x 1 worker)
    that learns (eval loss well below uniform over the vocabulary), and role=sample printing text."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    files = stdlib_files()[:150]
    for part in range(3):
        lines = (json.dumps({"text": p.read_text(errors="replace"), "path": p.name}) for p in files[part::3])
        (corpus / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "prepared"

    def run(*options: str) -> str:
        result = subprocess.run(
            [sys.executable, "run.py", *options], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    said = run(
        "role=prepare",
        f"prepare.input={corpus}",
        f"prepare.output={out}",
        "prepare.vocab_size=512",
        "prepare.workers=2",
        f"hydra.run.dir={tmp_path / 'prep_run'}",
    )
    assert "prepared: 150 documents" in said and f"data.path={out / 'tokens.bin'}" in said, said
    meta = json.loads(metadata_path(out / "tokens.bin").read_text())
    assert meta["tokenizer"]["vocab_size"] == 512 and meta["documents"] == 150
    assert [Path(s["path"]).name for s in meta["sources"]] == ["part0.jsonl", "part1.jsonl", "part2.jsonl"]

    again = tmp_path / "one_process"  # its saved tokenizer given back, one process: the same ids
    prepare_corpus(
        PrepareConfig(input=str(corpus), output=str(again), tokenizer=str(out / "tokenizer" / "tokenizer.json")),
        lambda line: None,
    )
    assert (again / "tokens.bin").read_bytes() == (out / "tokens.bin").read_bytes()

    job = compose_job(["data=tokens", f"data.path={out / 'tokens.bin'}"])
    assert job.data.vocab_size == job.model.vocab_size == 512 and job.data.token_dtype == "uint16"
    assert load_corpus(job.data).train.numel() > 500_000

    run_dir = tmp_path / "run"
    run(
        "data=tokens",
        f"data.path={out / 'tokens.bin'}",
        "cluster.groups=2",
        "cluster.workers_per_group=1",
        "logger=none",
        "trainer.max_steps=80",
        "algo.sync_every=20",
        "trainer.eval_every=0",
        f"hydra.run.dir={run_dir}",
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and summary["final_eval_loss"] < math.log(512) - 1.0, summary["final_eval_loss"]

    # role=eval on plain text: its held-out tail encoded with the model's tokenizer
    text = tmp_path / "unseen.py"
    text.write_text("\n".join(p.read_text(errors="replace") for p in stdlib_files()[300:320]))
    options = ["data=text", f"data.path={text}", "data.val_fraction=0.2", "cluster.workers_per_group=1"]
    scored = compose_job([*options, "trainer.batch_size=2", "trainer.eval_batches=4"])
    weights, trained_dir = locate_weights(str(run_dir))
    record = evaluate_checkpoint(scored, weights, trained_job_config(trained_dir, scored))
    assert record["tokens"] == 4 * 2 * 128 and record["eval_loss"] < math.log(512) - 1.0, record

    sampled = run(
        "role=sample",
        f"checkpoint={run_dir}",
        "sample.prompt='def main('",
        "sample.max_new_tokens=30",
        f"hydra.run.dir={tmp_path / 'sample'}",
    )
    assert sampled.startswith("def main(") and len(sampled) > len("def main(") + 20, sampled
