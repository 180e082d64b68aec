"""Writes tests/config/config_surface.txt: every key ``python run.py`` accepts, with its default.

Run ``python -m tests.config.regenerate_surface`` after adding, renaming or removing a key, or
changing a default, on purpose; ``test_config_surface.py`` fails until the file says so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from diloco.config.base import key_paths
from diloco.config.job import JobConfig

SURFACE = Path(__file__).with_name("config_surface.txt")
REGENERATE = "python -m tests.config.regenerate_surface"
HEADER = f"# Every config key with its JobConfig() default (a section: its key alone). Written by {REGENERATE}."


def surface() -> dict[str, str]:
    """key path -> its default as JSON, "" for a section (``key_paths(JobConfig)``'s order)."""
    defaults = JobConfig()
    out = {}
    for key in key_paths(JobConfig):
        value = defaults
        for part in key.split("."):
            value = getattr(value, part)
        out[key] = "" if dataclasses.is_dataclass(value) else json.dumps(value)
    return out


def line(key: str, default: str) -> str:
    return f"{key} = {default}" if default else key


def read_surface() -> dict[str, str]:
    """The checked-in surface, as ``surface`` returns it."""
    rows = (row.partition(" = ") for row in SURFACE.read_text().splitlines() if not row.startswith("#"))
    return {key: default for key, _, default in rows}


def main() -> None:
    SURFACE.write_text("\n".join([HEADER, *(line(k, d) for k, d in surface().items())]) + "\n")
    print(f"wrote {SURFACE}")


if __name__ == "__main__":
    main()
