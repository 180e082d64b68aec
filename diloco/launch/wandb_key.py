"""``logger.mode=online`` needs a wandb API key: checked before any worker starts.

Without one, every group's leader dies in ``wandb.init`` and is restarted until
``cluster.max_restarts`` gives up, a minute later, with wandb's stack. The key is looked up
where wandb looks (``wandb.sdk.lib.wbauth``: the ``WANDB_API_KEY`` or
``WANDB_IDENTITY_TOKEN_FILE`` variable, then the netrc entry ``wandb login`` writes for the
server's host, then an ``api_key`` in wandb's settings file), but in the environment
``run.py`` passes down rather than the process's own, and without importing wandb (a second
of imports in the launcher).
"""

from __future__ import annotations

import configparser
import netrc
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from diloco.config.base import ConfigError
from diloco.config.logger import LoggerConfig

DEFAULT_BASE_URL = "https://api.wandb.ai"
NO_KEY = "logger.mode=online needs a wandb API key: run `wandb login`, set WANDB_API_KEY, or use logger.mode=offline"


def check_wandb_key(logger: LoggerConfig, environ: Mapping[str, str]) -> None:
    """``ConfigError`` (``NO_KEY``) if ``logger.mode=online`` and wandb would find no key in ``environ``.

    ``WANDB_MODE=offline`` does not help: ``wandb.init(mode="online")``, as the workers call it,
    overrides the variable (wandb 0.31 still asks for a key), so only ``logger.mode`` counts."""
    if logger.mode != "online":
        return
    if not has_wandb_key(environ):
        raise ConfigError(NO_KEY)


def has_wandb_key(environ: Mapping[str, str]) -> bool:
    """Whether wandb, started with ``environ``, would find credentials for its server."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    home = Path(environ["HOME"]) if environ.get("HOME") else None
    return _netrc_has_key(_netrc_path(environ, home), environ) or _settings_have_key(environ, home)


def _netrc_path(environ: Mapping[str, str], home: Path | None) -> Path | None:
    if environ.get("NETRC"):
        return Path(environ["NETRC"]).expanduser()
    if home is None:
        return None
    unix = home / ".netrc"
    return unix if unix.exists() or not (home / "_netrc").exists() else home / "_netrc"


def _netrc_has_key(path: Path | None, environ: Mapping[str, str]) -> bool:
    if path is None or not path.is_file():
        return False
    try:
        entries = netrc.netrc(str(path))
    except (netrc.NetrcParseError, OSError):  # wandb warns and goes on without it
        return False
    host = urlsplit(environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).netloc
    found = entries.authenticators(host) if host else None
    return bool(found and found[2])


def _settings_have_key(environ: Mapping[str, str], home: Path | None) -> bool:
    """An ``api_key`` in wandb's global settings file (``WANDB_CONFIG_DIR``, else ~/.config/wandb)."""
    folder = environ.get("WANDB_CONFIG_DIR") or (str(home / ".config" / "wandb") if home else "")
    settings = Path(folder) / "settings" if folder else None
    if settings is None or not settings.is_file():
        return False
    parser = configparser.ConfigParser()
    try:
        parser.read(settings)
    except (configparser.Error, OSError, UnicodeError):
        return False
    return bool(parser.get("default", "api_key", fallback=""))
