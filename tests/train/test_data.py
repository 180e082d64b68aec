"""Corpus loading, sharding and resumption of the data pipeline (CPU, a few seconds)."""

from __future__ import annotations

import array
import os
import sysconfig
from pathlib import Path

import pytest
import torch

from diloco.config.base import ConfigError
from diloco.config.data import DataConfig
from diloco.run_paths import RunPaths
from diloco.train import data as data_module
from diloco.train.data import (
    ByteTokenizer,
    DataError,
    ShardedBatches,
    data_repeats_warning,
    eval_batches,
    load_corpus,
    read_corpus,
    stdlib_files,
)
from diloco.worker.builders import preflight
from tests.conftest import compose_job


@pytest.fixture(scope="module")
def stdlib_splits():
    return load_corpus(DataConfig())


def batches(tokens, **overrides):
    kwargs = dict(seq_len=4, micro_batch_size=2, grad_accum=1, group=0, num_groups=1, worker=0, num_workers=1, seed=0)
    kwargs.update(overrides)
    return ShardedBatches(tokens, **kwargs)


def window_starts(tokens, inputs):
    """Offsets in ``tokens`` of each row; tokens are arange, so the first id is the offset."""
    assert torch.equal(tokens, torch.arange(tokens.numel()))
    return [int(row[0]) for row in inputs]


def write_tokens(path: Path, values, typecode: str) -> Path:
    path.write_bytes(array.array(typecode, values).tobytes())
    return path


# --- tokenizer and config --------------------------------------------------------------


def test_byte_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🚀\n"
    ids = tok.encode(text)
    assert ids.dtype == torch.int64
    assert ids.numel() == len(text.encode("utf-8"))
    assert int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode([0xFF]) == "\ufffd"


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(corpus="text"), "data.path"),
        (dict(corpus="tokens", vocab_size=1000), "data.path"),
        (dict(path="/x"), "data.path"),
        (dict(val_fraction=0.0), "data.val_fraction"),
        (dict(val_fraction=0.5), "data.val_fraction"),
        (dict(vocab_size=512), "data.vocab_size"),
        (dict(corpus="text", path="/x", vocab_size=100), "data.vocab_size"),
        (dict(corpus="tokens", path="/x", vocab_size=70000), "data.vocab_size"),
        (dict(corpus="web"), "data.corpus"),
    ],
)
def test_config_validate_names_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DataConfig(**kwargs).validate()


def test_config_valid_cases():
    DataConfig().validate()
    DataConfig(corpus="text", path="/x").validate()
    DataConfig(corpus="tokens", path="/x", token_dtype="uint32", vocab_size=100_000).validate()


def test_text_path_required_message():
    with pytest.raises(ConfigError, match="required when data.corpus=text"):
        DataConfig(corpus="text").validate()


# --- corpora ---------------------------------------------------------------------------


def test_stdlib_corpus_loads_deterministically(stdlib_splits):
    s = stdlib_splits
    assert s.train.dtype == torch.uint8 and s.train.dim() == 1
    assert s.train.numel() > 1_000_000
    assert 0 < s.val.numel() < s.train.numel()
    again = read_corpus(DataConfig())  # a second read from disk, not the memoized splits
    assert again is not s and torch.equal(s.train, again.train) and torch.equal(s.val, again.val)
    assert load_corpus(DataConfig()) is load_corpus(DataConfig())  # memoized for forked workers


def test_stdlib_corpus_excludes_site_packages(stdlib_splits):
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    assert files and all(p.suffix == ".py" for p in files)
    for p in files:
        parts = p.relative_to(root).parts
        assert "site-packages" not in parts and "dist-packages" not in parts, p
    # The stream is exactly these files joined by newlines: nothing else got in.
    expected = sum(p.stat().st_size for p in files) + len(files) - 1
    assert stdlib_splits.train.numel() + stdlib_splits.val.numel() == expected
    first = files[0].read_bytes()
    assert bytes(stdlib_splits.train[: len(first)].tolist()) == first


def test_text_corpus_single_file(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("hello wörld\n" * 100, encoding="utf-8")
    s = load_corpus(DataConfig(corpus="text", path=str(f), val_fraction=0.1))
    assert bytes(torch.cat([s.train, s.val]).tolist()) == f.read_bytes()
    assert s.val.numel() == int(len(f.read_bytes()) * 0.1)


def test_a_text_file_that_is_not_utf8_is_refused_naming_the_byte_and_the_tokens_corpus(tmp_path, monkeypatch):
    """A file of token ids given as text would train a model on the ids' raw bytes and exit 0."""
    ids = tmp_path / "train.bin"
    ids.write_bytes("wörds ".encode() * 30 + bytes([0xC3, 0x28]) + b"tail")
    for chunk in (1, 2, 7, 1 << 24):  # a character cut by a chunk boundary is still found at its byte
        monkeypatch.setattr(data_module, "_UTF8_CHUNK", chunk)
        assert_data_error(DataConfig(corpus="text", path=str(ids)), ids, "byte 210 is not valid UTF-8")
    with pytest.raises(DataError, match="data.corpus=tokens"):
        load_corpus(DataConfig(corpus="text", path=str(ids)))


def test_text_corpus_folder_skips_binary_and_hidden(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 50, encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta " * 50, encoding="utf-8")
    (tmp_path / "blob.bin").write_bytes(bytes([0xFF, 0xFE, 0x00, 0x80]) * 20)
    (tmp_path / ".hidden.txt").write_text("SECRET", encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("SECRET", encoding="utf-8")
    s = load_corpus(DataConfig(corpus="text", path=str(tmp_path)))
    text = bytes(torch.cat([s.train, s.val]).tolist()).decode("utf-8")
    assert "alpha" in text and "beta" in text and "SECRET" not in text
    assert len(text) == 300 + 250 + 1


def test_tokens_corpus_round_trip(tmp_path):
    values = [(i * 7919) % 60000 for i in range(10_000)]
    f = write_tokens(tmp_path / "t16.bin", values, "H")
    s = load_corpus(DataConfig(corpus="tokens", path=str(f), vocab_size=60000))
    assert torch.cat([s.train, s.val]).to(torch.int64).tolist() == values
    assert s.val.numel() == 200

    big = [(i * 104729) % 100_000 for i in range(5_000)]
    f32 = write_tokens(tmp_path / "t32.bin", big, "I")
    cfg = DataConfig(corpus="tokens", path=str(f32), token_dtype="uint32", vocab_size=100_000)
    s32 = load_corpus(cfg)
    assert s32.train.dtype == torch.uint32
    assert torch.cat([s32.train, s32.val]).to(torch.int64).tolist() == big
    step = batches(s32.train, seq_len=8, micro_batch_size=3).next_step()
    assert step[0][0].dtype == torch.int64 and step[0][0].shape == (3, 8)


# --- errors name the path ---------------------------------------------------------------


def assert_data_error(cfg: DataConfig, path: Path, match: str = "") -> None:
    with pytest.raises(DataError, match=match) as info:
        load_corpus(cfg)
    assert str(path) in str(info.value)


def test_missing_path(tmp_path):
    p = tmp_path / "nope"
    assert_data_error(DataConfig(corpus="text", path=str(p)), p, "no such file")
    assert_data_error(DataConfig(corpus="tokens", path=str(p)), p, "no such file")


def test_empty_file_and_folder(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    assert_data_error(DataConfig(corpus="text", path=str(f)), f, "empty")
    assert_data_error(DataConfig(corpus="tokens", path=str(f)), f, "multiple")
    d = tmp_path / "folder"
    d.mkdir()
    assert_data_error(DataConfig(corpus="text", path=str(d)), d, "no non-empty UTF-8")
    (d / "x.bin").write_bytes(b"\xff\xfe")
    assert_data_error(DataConfig(corpus="text", path=str(d)), d, "no non-empty UTF-8")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path):
    f = tmp_path / "locked.txt"
    f.write_text("secret", encoding="utf-8")
    f.chmod(0)
    try:
        assert_data_error(DataConfig(corpus="text", path=str(f)), f, "cannot read")
        assert_data_error(DataConfig(corpus="text", path=str(tmp_path)), f, "cannot read")
    finally:
        f.chmod(0o644)


def test_read_error_is_data_error(tmp_path, monkeypatch):
    """The same path as an unreadable file, reachable even when the tests run as root."""
    f = tmp_path / "a.txt"
    f.write_text("hello", encoding="utf-8")

    def deny(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", deny)
    assert_data_error(DataConfig(corpus="text", path=str(f)), f, "cannot read.*Permission denied")


def test_tokens_odd_size(tmp_path):
    f = tmp_path / "odd.bin"
    f.write_bytes(b"\x01\x00\x02")
    assert_data_error(DataConfig(corpus="tokens", path=str(f)), f, "size 3 bytes")


def test_tokens_id_out_of_vocab(tmp_path):
    f = write_tokens(tmp_path / "t.bin", [1, 2, 3, 500, 4], "H")
    assert_data_error(
        DataConfig(corpus="tokens", path=str(f), vocab_size=256), f, "token id 500 at position 3.*data.vocab_size=256"
    )


def test_a_uint32_file_read_as_uint16_is_refused_naming_the_key(tmp_path):
    """Read as uint16, a uint32 file is its ids interleaved with zeros: refused in one line."""
    ids = [(i * 7919) % 50_000 + 1 for i in range(5_000)]
    f = write_tokens(tmp_path / "t32.bin", ids, "I")
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(corpus="tokens", path=str(f), vocab_size=50_001))
    message = str(info.value)
    assert "\n" not in message and str(f) in message
    assert "data.token_dtype=uint16" in message and "set data.token_dtype=uint32" in message
    cfg = DataConfig(corpus="tokens", path=str(f), token_dtype="uint32", vocab_size=50_001)
    splits = load_corpus(cfg)
    assert torch.cat([splits.train, splits.val]).to(torch.int64).tolist() == ids


def test_the_other_wrong_width_and_uint16_files_with_many_zeros(tmp_path):
    # a uint16 file read as uint32 pairs its ids into ids beyond any uint16 vocabulary
    f16 = write_tokens(tmp_path / "t16.bin", [(i * 7919) % 60000 + 1 for i in range(1_000)], "H")
    cfg = DataConfig(corpus="tokens", path=str(f16), token_dtype="uint32", vocab_size=60001)
    assert_data_error(cfg, f16, "is >= data.vocab_size=60001.*check data.token_dtype")
    # zeros at most odd places, or a file too short to tell, are a corpus
    some = write_tokens(tmp_path / "zeros.bin", [i % 7 if i % 2 == 0 or i == 999 else 0 for i in range(1_000)], "H")
    assert load_corpus(DataConfig(corpus="tokens", path=str(some), vocab_size=7)).train.numel() > 0
    short = write_tokens(tmp_path / "short.bin", [5, 0] * 31, "H")
    assert load_corpus(DataConfig(corpus="tokens", path=str(short), vocab_size=7)).train.numel() > 0


# --- sharded batches -------------------------------------------------------------------


def epoch_starts(tokens, **kw):
    b = batches(tokens, **kw)
    starts = []
    for _ in range(b.n_windows // (kw.get("micro_batch_size", 2))):
        for inputs, targets in b.next_step():
            assert torch.equal(inputs[:, 1:], targets[:, :-1])
            starts += window_starts(tokens, inputs)
    return b, starts


def test_shards_of_groups_are_disjoint_and_deterministic():
    tokens = torch.arange(2000)
    seen = []
    for g in range(2):
        b, starts = epoch_starts(tokens, group=g, num_groups=2, seq_len=10, micro_batch_size=3)
        assert len(starts) == len(set(starts)) == b.n_windows - b.n_windows % 3
        lo, hi = g * 1000, (g + 1) * 1000
        assert all(lo <= s and s + 10 < hi for s in starts)
        assert starts == epoch_starts(tokens, group=g, num_groups=2, seq_len=10, micro_batch_size=3)[1]
        seen.append(set(starts))
    assert not seen[0] & seen[1]


def test_different_seeds_shuffle_differently():
    tokens = torch.arange(1000)
    a = batches(tokens, seed=0).next_step()[0][0]
    b = batches(tokens, seed=1).next_step()[0][0]
    assert not torch.equal(a, b)


def test_epoch_rollover_visits_every_window_once_per_epoch():
    tokens = torch.arange(101)  # 25 windows of 4+1
    b = batches(tokens, micro_batch_size=5)
    assert b.n_windows == 25 and b.tokens_per_step == 20
    starts = []
    for _ in range(15):  # three epochs
        starts += window_starts(tokens, b.next_step()[0][0])
    epochs = [starts[i : i + 25] for i in range(0, 75, 25)]
    for e in epochs:
        assert sorted(e) == list(range(0, 100, 4))
    assert epochs[0] != epochs[1]
    assert b.consumed == 75


def test_step_straddling_epochs():
    tokens = torch.arange(29)  # 7 windows; steps of 3 cross epoch boundaries
    b = batches(tokens, micro_batch_size=3)
    starts = [s for _ in range(7) for s in window_starts(tokens, b.next_step()[0][0])]
    for e in range(3):
        assert sorted(starts[7 * e : 7 * (e + 1)]) == list(range(0, 28, 4))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_one_worker_equals_two_workers(grad_accum):
    tokens = torch.arange(3000)
    common = dict(seq_len=8, grad_accum=grad_accum, num_groups=2, group=1, seed=3)
    one = batches(tokens, micro_batch_size=4, num_workers=1, worker=0, **common)
    two = [batches(tokens, micro_batch_size=2, num_workers=2, worker=r, **common) for r in range(2)]
    assert one.tokens_per_step == two[0].tokens_per_step
    for _ in range(5):
        big = one.next_step()
        halves = [w.next_step() for w in two]
        for a in range(grad_accum):
            for k in range(2):  # inputs, targets
                joined = torch.cat([halves[0][a][k], halves[1][a][k]])
                assert torch.equal(big[a][k], joined)
    assert one.consumed == two[0].consumed == two[1].consumed


def test_resume_continues_without_replay():
    tokens = torch.arange(5000)
    kw = dict(seq_len=16, micro_batch_size=3, grad_accum=2, num_workers=2, worker=1, seed=5)
    original = batches(tokens, **kw)
    for _ in range(20):
        original.next_step()
    state = original.state_dict()
    assert all(type(v) is int for v in state.values())
    assert set(state) == {"consumed", "n_windows", "seed", "group"}
    resumed = batches(tokens, **kw)
    resumed.load_state_dict(dict(state))
    for _ in range(30):  # crosses an epoch boundary (312 windows, 12 per step)
        for (xa, ya), (xb, yb) in zip(original.next_step(), resumed.next_step()):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("change", [dict(group=1), dict(seed=9), dict(seq_len=8)])
def test_load_state_dict_rejects_other_stream(change):
    tokens = torch.arange(4000)
    state = batches(tokens, num_groups=2).state_dict()
    other = batches(tokens, **{"num_groups": 2, **change})
    with pytest.raises(DataError, match="different stream"):
        other.load_state_dict(state)


def test_shard_too_small():
    with pytest.raises(DataError, match="holds 20 tokens"):
        batches(torch.arange(40), num_groups=2, micro_batch_size=8)


# --- eval batches ----------------------------------------------------------------------


def test_eval_batches_split_across_workers():
    val = torch.arange(400)
    kw = dict(seq_len=5, batch_size=3, max_batches=4, num_workers=2)
    per_worker = [eval_batches(val, worker=r, **kw) for r in range(2)]
    assert len(per_worker[0]) == len(per_worker[1]) == 4
    starts = []
    for k in range(4):
        for r in range(2):
            inputs, targets = per_worker[r][k]
            assert inputs.shape == targets.shape == (3, 5)
            assert torch.equal(inputs[:, 1:], targets[:, :-1])
            starts += window_starts(val, inputs)
    assert starts == list(range(0, 24 * 5, 5))


def test_eval_batches_drop_ragged_tail_and_too_small():
    val = torch.arange(71)  # 14 windows: two full batches of 2x3, ragged tail dropped
    out = eval_batches(val, seq_len=5, batch_size=3, max_batches=10, worker=1, num_workers=2)
    assert len(out) == 2
    with pytest.raises(DataError, match="data.val_fraction"):
        eval_batches(torch.arange(20), seq_len=5, batch_size=3, max_batches=1, worker=0, num_workers=2)


def test_stdlib_eval_batches(stdlib_splits):
    out = eval_batches(stdlib_splits.val, seq_len=64, batch_size=4, max_batches=2, worker=0, num_workers=1)
    assert len(out) == 2 and out[0][0].dtype == torch.int64


def test_a_job_that_reads_its_data_more_than_once_says_so():
    """4 groups x 2 workers x 8 sequences of 128: 2,048 tokens per group step, 650k-token shards."""
    job = compose_job(["cluster.groups=4", "trainer.max_steps=500"])
    assert data_repeats_warning(job, 2_600_000) == (
        "warning: 500 steps x 4 groups read 4.1M tokens, 1.6 epochs of the 2.6M-token training split: "
        "the data repeats (more data: data=text data.path=... or data=tokens)"
    )
    assert data_repeats_warning(job, 4_200_000) is None  # 0.98 epochs: each window read at most once
    tensor_parallel = compose_job(["cluster.groups=4", "trainer.max_steps=500", "parallel.tp=2"])
    assert data_repeats_warning(tensor_parallel, 2_600_000) is None  # one batch per step for both tp workers
    text = compose_job(
        ["cluster.groups=4", "trainer.max_steps=500", "trainer.grad_accum=2", "data=text", f"data.path={__file__}"]
    )
    assert data_repeats_warning(text, 2_600_000).endswith(
        "3.2 epochs of the 2.6M-token training split: the data repeats (more data: a larger corpus at data.path)"
    )


def test_preflight_says_it_once_for_the_launcher(tmp_path):
    said = []
    preflight(compose_job(["cluster.groups=4", "trainer.max_steps=5000"]), RunPaths(tmp_path), said.append)
    assert len(said) == 1 and said[0].startswith("warning: 5000 steps x 4 groups read 41.0M tokens, 1.3 epochs of the ")
