"""Shared fixtures: the real conf/ tree composed with hydra, shrunk for tests."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from diloco.config.job import JobConfig, job_config_from_dict
from diloco.launch.compose import compose_config, plain_config

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
CONF_GROUPS = frozenset(p.name for p in CONF_DIR.iterdir() if p.is_dir())
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # tests talk to lighthouses on loopback only


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip where torch sees no CUDA device (CI's machines have none)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_experiment(script: str, args: list[str], timeout_s: float) -> tuple[str, str]:
    """Run ``python -m <script>`` (e.g. ``experiments.gpu.gpu_check``) with ``args``; its (stdout, stderr), the test failing if it
    fails or outlasts ``timeout_s``.

    Popen, not run: on a timeout the script is SIGKILLed (SIGTERM would be a planned stop, which
    waits for the groups' rounds), and the job's processes die with it (they watch its lifeline).
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", script, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{script} took over {timeout_s}s:\n{out}\n{err[-12000:]}")
    assert proc.returncode == 0, f"{script} failed:\n{out}\n{err[-12000:]}"
    return out, err


def process_exited(process: subprocess.Popen, output: Callable[[], str] = lambda: "") -> Callable[[], str | None]:
    """``wait_until``'s ``gone`` for a process started with Popen: its exit ends the wait, with ``output()``."""
    return lambda: None if process.poll() is None else f"it exited with code {process.returncode}\n{output()}"


# Small enough that a multi-process run takes seconds on two cores.
FAST = [
    "logger=none",
    "cluster.groups=1",
    "algo.sync_every=10",
    "trainer.max_steps=20",
    "trainer.eval_every=0",
    "trainer.eval_batches=2",
    "trainer.log_every=5",
]


def compose_job(overrides: list[str]) -> JobConfig:
    """The JobConfig ``python run.py *overrides`` would build."""
    return _composed(tuple(overrides))


@functools.cache  # frozen, so tests may share it
def _composed(overrides: tuple[str, ...]) -> JobConfig:
    return job_config_from_dict(compose_raw_quickly(list(overrides)))


def compose_raw_quickly(overrides: list[str]) -> dict:
    """``diloco.launch.compose.compose_raw`` in hydra's two steps: the defaults list with the group
    selections (about 90 ms: done once per distinct selection), then the key=value overrides applied
    to a copy by OmegaConf's public API under hydra's rules (a few ms each). Plain ``hydra.compose``
    for each distinct list would add about 5 s to the fast tests (133 lists, 60 selections among
    them), and as much again to the experiments' (``tests/experiments/conftest.py``).
    ``test_the_shortcut_composes_as_hydra_does`` holds it to hydra's composition in one go."""
    parsed = _override_parser().parse_overrides(list(overrides))
    selections = tuple(o.input_line for o in parsed if _selects_a_group(o))
    cfg = copy.deepcopy(_composed_selections(selections))
    for override in parsed:
        if not _selects_a_group(override):
            _apply(override, cfg)
    return plain_config(cfg)


def _apply(override: Override, cfg: DictConfig) -> None:
    """``key=value`` (the key must exist: the config is in struct mode), ``+key=value`` (the key
    must not), ``++key=value`` (either) or ``~key``, with hydra's errors."""
    key, value, line = override.key_or_group, override.value(), override.input_line
    try:
        if override.is_delete():
            present = OmegaConf.select(cfg, key, throw_on_missing=False)
            if present is None:
                raise ConfigCompositionException(f"Could not delete from config. '{key}' does not exist.")
            if value is not None and value != present:
                raise ConfigCompositionException(
                    f"Could not delete from config. The value of '{key}' is {present} and not {value}."
                )
            parent, _, leaf = key.rpartition(".")
            with open_dict(cfg):
                del (OmegaConf.select(cfg, parent) if parent else cfg)[leaf]
        elif override.is_add() and OmegaConf.select(cfg, key, throw_on_missing=False) is not None:
            if not isinstance(value, (dict, list)):  # a dict or list merges into what is there
                raise ConfigCompositionException(f"Could not append to config. An item is already at '{key}'.")
            OmegaConf.update(cfg, key, value, merge=True, force_add=True)
        else:  # key=value must find its key (struct mode); +key and ++key may add it
            OmegaConf.update(cfg, key, value, merge=True, force_add=override.type != OverrideType.CHANGE)
    except (ConfigAttributeError, ConfigKeyError) as error:
        if override.type != OverrideType.CHANGE:
            raise ConfigCompositionException(f"Error merging override {line}") from error
        raise ConfigCompositionException(
            f"Could not override '{key}'.\nTo append to your config use +{line}"
        ) from error
    except OmegaConfBaseException as error:
        raise ConfigCompositionException(f"Error merging override {line}") from error


@functools.cache
def _composed_selections(selections: tuple[str, ...]) -> DictConfig:
    return compose_config(list(selections))


@functools.cache
def _override_parser() -> OverridesParser:
    return OverridesParser.create()


def _selects_a_group(override) -> bool:
    group = override.key_or_group
    return group in CONF_GROUPS or "/" in group or override.package is not None


@pytest.fixture
def fast_job():
    """A factory: ``fast_job("trainer.max_steps=5", ...)`` composes FAST plus the given overrides."""

    def make(*overrides: str) -> JobConfig:
        return compose_job(FAST + list(overrides))

    return make
