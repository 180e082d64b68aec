"""The settings a trained model is used with (``role=eval``, ``role=sample``, ``role=export``):
its run's, from the config.yaml the run saved, unless the command line sets them.

``role=eval checkpoint=RUN`` so scores what the run evaluated on (its data, the length, count
and width of its windows) with no option repeated, and a corpus named on the command line
instead is said in one line and recorded. The model's shape is always the run's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from diloco.config.base import to_dict
from diloco.config.data import DataConfig
from diloco.config.job import JobConfig, job_config_from_dict
from diloco.config.tokens_meta import metadata_path

# What each role reads of the run: the data role=eval scores and the windows it cuts (their
# length, count, and sequences per batch: batch_size x the data-parallel degree), or the data
# whose tokenizer role=sample and role=export use.
RUN_SETTINGS = {
    "eval": (
        "data",
        "trainer.seq_len",
        "trainer.eval_batches",
        "trainer.batch_size",
        "cluster.workers_per_group",
        "parallel",
    ),
    "sample": ("data",),
    "export": ("data",),
}
# This invocation's own, never the run's: what to do, with which model, the prompt, the device here.
INVOCATION_KEYS = ("role", "checkpoint", "sample", "cluster.device")
CORPUS_DECIDES = ("data.vocab_size", "data.token_dtype")  # a prepared corpus's tokens.json sets them
# What ``data=text`` (a conf/data preset) names: a corpus, not how much of it is held out.
CORPUS_KEYS = ("data.corpus", "data.path", *CORPUS_DECIDES)
SAID_AS = {"eval": "scoring", "sample": "sampling through the tokenizer of", "export": "exporting the tokenizer of"}


def override_keys(overrides: Iterable[str]) -> frozenset[str]:
    """The keys hydra's command-line overrides set: ``data=text`` sets ``data``,
    ``+model.vocab_size=8`` sets ``model.vocab_size``."""
    return frozenset(o.split("=", 1)[0].lstrip("+~").split("@", 1)[0] for o in overrides)


def command_line_settings(explicit: Iterable[str], settings: Iterable[str]) -> list[str]:
    """The keys of ``settings`` the command line set (``explicit``): a key inside one
    (``data.path``), or one inside a section it set (``trainer.seq_len`` of ``trainer=default``);
    ``data=...`` sets the corpus (``CORPUS_KEYS``), and the run's ``data.val_fraction`` stays."""
    settings = tuple(settings)
    explicit = [named for key in explicit for named in (CORPUS_KEYS if key == "data" else (key,))]
    given = {key for key in explicit for s in settings if key == s or key.startswith(s + ".")}
    given |= {s for s in settings for key in explicit if s.startswith(key + ".")}
    return sorted(given)


def with_run_settings(
    raw: dict[str, Any], trained: JobConfig, explicit: Iterable[str], role: str
) -> tuple[JobConfig, list[str]]:
    """The job a trained model is used with: the job that trained it with this invocation's own
    keys and the run settings the command line set (``raw``, the composed command line); and
    which settings those were. Validated as a whole, so a window longer than the model's is refused."""
    merged = to_dict(trained)
    given = command_line_settings(explicit, RUN_SETTINGS[role])
    for key in (*INVOCATION_KEYS, *given):
        _copy_key(raw, merged, key)
    _follow_new_corpus(merged["data"], given)
    return job_config_from_dict(merged), given


def _copy_key(source: dict[str, Any], target: dict[str, Any], dotted: str) -> None:
    """``target[dotted] = source[dotted]``, making sections as needed; a key ``source`` lacks
    (deleted with ``~key``) is dropped, so its default applies."""
    *sections, last = dotted.split(".")
    for section in sections:
        source = source.get(section) or {}
        target = target.setdefault(section, {})
    if last in source:
        target[last] = copy.deepcopy(source[last])
    else:
        target.pop(last, None)


def _follow_new_corpus(data: dict[str, Any], given: list[str]) -> None:
    """A prepared token file the command line names decides its vocabulary and width (its
    tokens.json), as when training on it; a bare one is read as the run's corpus was."""
    named = {"data.path", "data.corpus"} & set(given)
    if named and data.get("corpus") == "tokens" and data.get("path") and metadata_path(data["path"]).is_file():
        for key in CORPUS_DECIDES:
            if key not in given:
                data[key.removeprefix("data.")] = None


def overridden_line(role: str, used: JobConfig, trained: JobConfig, given: list[str]) -> str | None:
    """One line naming the run settings the command line changed, with the run's, or None (the
    vocabulary and width that follow the corpus left out: eval.json has them)."""
    mine, theirs = _leaves(to_dict(used), given), _leaves(to_dict(trained), given)
    changed = [k for k in mine if mine[k] != theirs.get(k) and k not in CORPUS_DECIDES]
    if not changed:
        return None
    return f"{SAID_AS[role]} {_shown(mine, changed)} (command line) instead of the run's {_shown(theirs, changed)}"


def _leaves(config: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """The values under ``keys`` of a nested config, by dotted key (``data`` -> ``data.path``, ...)."""
    found = {}
    for key in keys:
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        found |= _flat(key, value)
    return found


def _flat(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        return {key: value}
    return {k: v for name, inner in value.items() for k, v in _flat(f"{key}.{name}", inner).items()}


def _shown(values: dict[str, Any], keys: list[str]) -> str:
    """``data.corpus=text data.path=/x`` as a user types it: ``data=text data.path=/x``."""
    return " ".join(f"{'data' if k == 'data.corpus' else k}={_typed(values.get(k))}" for k in keys)


def _typed(value: Any) -> str:
    return "null" if value is None else str(value)


def data_words(data: DataConfig) -> str:
    """The corpus as a command line names it: ``data=stdlib``, ``data=tokens data.path=corpus/tokens.bin``."""
    return f"data={data.corpus}" + (f" data.path={data.path}" if data.path else "")
