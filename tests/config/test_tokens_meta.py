"""tokens.json decides a prepared corpus's vocabulary and width; the model's vocabulary must hold it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from diloco.config.base import ConfigError
from diloco.config.job import job_config_from_dict
from diloco.config.tokens_meta import (
    CorpusMeta,
    SourceFile,
    TokenizerInfo,
    metadata_path,
    resolve_data_section,
    token_dtype_for,
)
from diloco.train.corpus_meta import read_corpus_meta, tokenizer_folder
from diloco.train.data import DataError, load_corpus


def prepared(folder: Path, vocab_size: int = 1000, tokens: int = 4096, token_dtype: str = "uint16") -> Path:
    """A token file and its metadata as role=prepare writes them (ids below ``vocab_size``)."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.arange(tokens) % vocab_size
    ids.astype("<u2" if token_dtype == "uint16" else "<u4").tofile(folder / "tokens.bin")
    info = TokenizerInfo(source="test", sha256="0" * 64, vocab_size=vocab_size, eos_id=0, eos_token="</s>")
    meta = CorpusMeta(
        info, token_dtype, documents=3, tokens=tokens, sources=(SourceFile("a.jsonl", 10),), text_field="text"
    )
    metadata_path(folder / "tokens.bin").write_text(json.dumps(meta.to_json()))
    return folder / "tokens.bin"


def tokens_data(path: Path, **given) -> dict:
    return {"corpus": "tokens", "path": str(path), "vocab_size": None, "token_dtype": None, **given}


def test_the_metadata_decides_the_vocabulary_and_width_and_the_model_follows(tmp_path):
    path = prepared(tmp_path / "p")
    job = job_config_from_dict({"data": tokens_data(path)})
    assert (job.data.vocab_size, job.data.token_dtype, job.model.vocab_size) == (1000, "uint16", 1000)
    assert read_corpus_meta(job.data).documents == 3
    assert load_corpus(job.data).train.numel() + load_corpus(job.data).val.numel() == 4096
    bigger = job_config_from_dict({"data": tokens_data(path), "model": {"vocab_size": 1024}})  # padded rows: allowed
    assert bigger.model.vocab_size == 1024 and bigger.data.vocab_size == 1000
    assert job_config_from_dict({"data": tokens_data(path, vocab_size=1000)}).data.vocab_size == 1000  # agrees


def test_a_tokenizer_larger_than_the_model_is_refused_naming_both(tmp_path):
    with pytest.raises(
        ConfigError, match=r"model.vocab_size=512: is smaller than the tokenizer's vocabulary, data.vocab_size=1000"
    ):
        job_config_from_dict({"data": tokens_data(prepared(tmp_path)), "model": {"vocab_size": 512}})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"vocab_size": 65536},
            r"data.vocab_size=65536: differs from 1000, the tokenizer's, recorded in .*tokens.json",
        ),
        ({"token_dtype": "uint32"}, r"data.token_dtype='uint32': differs from 'uint16', the tokenizer's"),
    ],
)
def test_a_value_given_that_the_metadata_contradicts_is_refused_naming_both(tmp_path, given, message):
    with pytest.raises(ConfigError, match=message):
        resolve_data_section(tokens_data(prepared(tmp_path), **given))


def test_a_token_file_without_metadata_reads_as_before(tmp_path):
    np.arange(300, dtype="<u2").tofile(tmp_path / "old.bin")
    data = resolve_data_section(tokens_data(tmp_path / "old.bin"))
    assert (data["vocab_size"], data["token_dtype"]) == (65536, "uint16")
    job = job_config_from_dict({"data": tokens_data(tmp_path / "old.bin", vocab_size=300)})
    assert job.model.vocab_size == 300 and tokenizer_folder(job.data) is None and read_corpus_meta(job.data) is None
    with pytest.raises(ConfigError, match=r"data.vocab_size=None: required for a token file without metadata"):
        job_config_from_dict({"data": tokens_data(tmp_path / "old.bin", token_dtype="uint32")})


def test_metadata_that_does_not_describe_its_token_file_is_refused(tmp_path):
    path = prepared(tmp_path)
    with path.open("ab") as fh:
        fh.write(b"\0\0")
    with pytest.raises(ConfigError, match=r"tokens.bin: 8,194 bytes, but .*tokens.json records 4,096 uint16 tokens"):
        resolve_data_section(tokens_data(path))
    metadata_path(path).write_text('{"format": "something else"}')
    with pytest.raises(ConfigError, match=r'tokens.json: not the metadata of a prepared token file \(no "format"'):
        resolve_data_section(tokens_data(path))


def test_the_metadata_given_for_its_token_file_names_the_token_file(tmp_path):
    meta = metadata_path(prepared(tmp_path / "corpus"))
    with pytest.raises(ConfigError) as refused:
        job_config_from_dict({"data": tokens_data(meta)})
    assert str(refused.value) == (
        f"data.path={meta}: must be the token file, {tmp_path / 'corpus' / 'tokens.bin'}, not its metadata "
        "(the .json beside the token file is read from there)"
    )


def test_the_tokenizer_folder_must_hold_the_tokenizer_the_metadata_names(tmp_path):
    path = prepared(tmp_path)
    job = job_config_from_dict({"data": tokens_data(path)})
    with pytest.raises(DataError, match=r"tokenizer: no tokenizer.json, which .*tokens.json names as its tokenizer"):
        tokenizer_folder(job.data)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    assert tokenizer_folder(job.data) == tmp_path / "tokenizer"


def test_the_token_width_is_the_narrowest_that_holds_the_vocabulary():
    assert [token_dtype_for(n) for n in (256, 65536, 65537, 128256)] == ["uint16", "uint16", "uint32", "uint32"]
