"""Typed configuration: plain dicts in, validated frozen dataclasses out.

Each component owns a small dataclass (``ModelConfig`` in ``model.py`` and so on) and its
``validate()``; this module holds what they share: the error type and a strict converter
that names the offending key, its value and what is allowed. It never imports hydra, so the
library stays usable without it (``run.py`` hands it a plain, resolved dict).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value a user can fix; the message names the key and the fix."""


def check(ok: bool, key: str, value: Any, requirement: str) -> None:
    """Raise ``ConfigError("key=value: requirement")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {requirement}")


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, checking keys and value types recursively.

    ``prefix`` is the dotted path of ``data`` inside the whole config, so errors name the
    key exactly as a user writes it on the command line (``trainer.max_steps``).
    """
    where = prefix or "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        guess = closest(unknown[0], fields)
        raise ConfigError(
            f"unknown key {_join(prefix, unknown[0])}; "
            + (f"did you mean {_join(prefix, guess)}? " if guess else "")
            + f"allowed keys of {where}: {', '.join(sorted(fields))}"
        )
    hints = get_type_hints(cls)
    kwargs = {name: _convert(hints[name], data[name], _join(prefix, name)) for name in data}
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing key {_join(prefix, missing[0])}")
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """The JSON-friendly form of a config dataclass (tuples become lists)."""
    return dataclasses.asdict(obj)


def flat_keys(sections: dict[str, Any]) -> dict[str, Any]:
    """``{"algo": AlgoConfig(...)}`` -> ``{"algo.sync_every": 50, ...}``, tuples as lists: configs
    as the lighthouse compares them across groups, each key named as a user writes it."""
    return {
        f"{section}.{key}": list(value) if isinstance(value, tuple) else value
        for section, config in sections.items()
        for key, value in to_dict(config).items()
    }


def key_paths(cls: type, prefix: str = "") -> list[str]:
    """Every key of dataclass ``cls`` as the command line names it (``trainer``, ``trainer.checkpoint``,
    ``trainer.checkpoint.every``): what ``run.py`` checks a ``key=value`` against before hydra."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init:
            key = _join(prefix, f.name)
            keys.append(key)
            if dataclasses.is_dataclass(hints[f.name]):
                keys += key_paths(hints[f.name], key)
    return keys


@dataclasses.dataclass(frozen=True)
class KeysRead:
    """Which keys of the config group ``group`` (dataclass ``cls``) each of its choices, its ``name``
    field, reads.

    A key its choice does not read, set to another value than the one the choice runs with
    (``runs_with``, else the field's default, so a preset's own values pass), would do nothing:
    a single run refuses it in one line (``check``), a ``-m`` sweep resets it and says so (``reset``).
    ``does``: what a choice does instead, said after "which" (else: it does not read the keys).
    """

    group: str
    cls: type
    reads: dict[str, tuple[str, ...]]
    does: dict[str, str] = dataclasses.field(default_factory=dict)
    runs_with: dict[str, dict[str, object]] = dataclasses.field(default_factory=dict)

    def unread(self, cfg: Any) -> dict[str, tuple[object, object]]:
        """The keys ``cfg``'s choice does not read, set otherwise: key -> (value, the value it runs with)."""
        used = {f.name: f.default for f in dataclasses.fields(cfg)} | self.runs_with.get(cfg.name, {})
        read = self.reads[cfg.name]
        return {
            key: (getattr(cfg, key), value)
            for key, value in used.items()
            if key != "name" and key not in read and getattr(cfg, key) != value
        }

    def check(self, cfg: Any) -> None:
        """Raise ``ConfigError`` naming the unread keys, and the choices that read them all."""
        if not (unread := self.unread(cfg)):
            return
        it = "it" if len(unread) == 1 else "them"
        readers = [name for name, keys in self.reads.items() if all(key in keys for key in unread)]
        reads = "reads" if len(readers) == 1 else "read"
        use = f", or use {' or '.join(f'{self.group}={name}' for name in readers)}, which {reads} {it}"
        raise ConfigError(f"{self._said(cfg, unread)}; remove {it}{use if readers else ''}")

    def reset(self, raw: dict[str, Any]) -> str | None:
        """In a ``-m`` sweep: set the unread keys of the plain config ``raw`` to the values its choice
        runs with, and say so in one line (None: nothing to reset)."""
        cfg = from_dict(self.cls, raw.get(self.group), self.group)
        if not (unread := self.unread(cfg)):
            return None
        used = {key: list(value) if isinstance(value, tuple) else value for key, (_, value) in unread.items()}
        raw[self.group] = {**raw[self.group], **used}
        return f"{self._said(cfg, unread)}; ignored in this job"

    def _said(self, cfg: Any, unread: dict[str, tuple[object, object]]) -> str:
        settings = ", ".join(f"{self.group}.{key}={value!r}" for key, (value, _) in unread.items())
        it, does = ("it", "does") if len(unread) == 1 else ("them", "do")
        return f"{settings} {does} nothing with {self.group}={cfg.name}, which {self.does.get(cfg.name, f'does not read {it}')}"


def closest(word: str, options: typing.Iterable[str], cutoff: float = 0.6) -> str | None:
    """The option ``word`` is most likely a typo of, or None when none is ``cutoff`` close (difflib's ratio)."""
    matches = difflib.get_close_matches(word, list(options), n=1, cutoff=cutoff)
    return matches[0] if matches else None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value, key)
        raise TypeError(f"unsupported config type {tp} for {key}")
    if origin is Literal:
        allowed = get_args(tp)
        check(value in allowed, key, value, f"must be one of {', '.join(map(str, allowed))}")
        return value
    if origin is tuple and len(get_args(tp)) == 2 and get_args(tp)[1] is Ellipsis:
        check(isinstance(value, (list, tuple)), key, value, "must be a list")
        return tuple(_convert(get_args(tp)[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        args = get_args(tp)
        check(
            isinstance(value, (list, tuple)) and len(value) == len(args),
            key,
            value,
            f"must be a list of {len(args)} values",
        )
        return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        check(isinstance(value, bool), key, value, "must be true or false")
        return value
    if tp is int:
        check(isinstance(value, int) and not isinstance(value, bool), key, value, "must be an integer")
        return value
    if tp is float:
        check(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "must be a number")
        return float(value)
    if tp is str:
        check(isinstance(value, str), key, value, "must be a string")
        return value
    if tp is typing.Any:
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")
