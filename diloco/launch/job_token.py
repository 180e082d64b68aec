"""The job's token for the roles ``run.py`` runs: read from ``cluster.lighthouse.token_file`` or the
environment's ``DILOCO_LIGHTHOUSE_TOKEN``, never given as a value.

A value on the command line would be saved by hydra before any of our code runs (the run
directory's ``.hydra/overrides.yaml``, ``config.yaml``, ``hydra.yaml``), which every group of a
multi-host job shares, and kept in the shell's history: ``token_problem_on_command_line`` refuses
it before hydra writes anything (docs/design.md, invariant 8).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from diloco.config.base import ConfigError
from diloco.config.job import JobConfig
from diloco.config.redaction import TOKEN_ENV

TOKEN_KEY = "cluster.lighthouse.token"
HOW = f"put the token in a file and pass cluster.lighthouse.token_file=PATH, or set {TOKEN_ENV}"
ROLES_WITH_A_TOKEN = ("local", "lighthouse", "group")  # the others speak to no lighthouse
_TOKEN_IN_A_MAPPING = re.compile(r"\btoken\s*:")  # cluster.lighthouse={token: ...}; token_file does not match


def token_problem_on_command_line(argv: list[str]) -> str | None:
    """The one-line refusal of a token given as a value on the command line (in any override form), or None."""
    for arg in argv:
        key, given, value = arg.partition("=")
        key = key.lstrip("+~")
        if not given or value.strip() in ("", "''", '""', "null"):  # no token: nothing to keep out of the files
            continue
        if key == TOKEN_KEY or (key in ("cluster", "cluster.lighthouse") and _TOKEN_IN_A_MAPPING.search(value)):
            return f"error: {TOKEN_KEY} on the command line would be saved in the run directory by hydra; {HOW}"
    return None


def with_job_token(job: JobConfig, environ: Mapping[str, str]) -> JobConfig:
    """``job`` with its token read from ``cluster.lighthouse.token_file``, else from the environment
    (unchanged if neither gives one: a local job then makes its own). Roles that speak to no
    lighthouse read nothing."""
    lighthouse = job.cluster.lighthouse
    if lighthouse.token:  # a config file set it: hydra has saved it in .hydra/config.yaml already
        raise ConfigError(f"{TOKEN_KEY} is set in a config file (hydra saves a copy of it); remove it and {HOW}")
    if job.role not in ROLES_WITH_A_TOKEN:
        return job
    if lighthouse.token_file:
        token, source = read_token_file(lighthouse.token_file), f"cluster.lighthouse.token_file={lighthouse.token_file}"
    else:
        token, source = environ.get(TOKEN_ENV, "").strip(), TOKEN_ENV
    if not token:
        return job
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ConfigError(f"{source}: the token must be one line of printable ASCII without spaces")
    lighthouse = dataclasses.replace(lighthouse, token=token)
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, lighthouse=lighthouse))


def read_token_file(path: str) -> str:
    """The token ``path`` holds (surrounding whitespace, such as the final newline, removed)."""
    key = f"cluster.lighthouse.token_file={path}"
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigError(f"{key}: no such file; write the job's token there (e.g. openssl rand -hex 16)") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise ConfigError(f"{key}: cannot read the token: {reason}") from None
    if not token:
        raise ConfigError(f"{key}: the file is empty; write the job's token there (e.g. openssl rand -hex 16)")
    return token
