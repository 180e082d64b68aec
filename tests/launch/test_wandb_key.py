"""``logger.mode=online`` without a wandb API key is refused before any worker starts, in one line
(not six crash-and-restart cycles and wandb's stack a minute later)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diloco.config.base import ConfigError
from diloco.config.logger import LoggerConfig
from diloco.launch.wandb_key import NO_KEY, check_wandb_key, has_wandb_key
from tests.conftest import REPO

ONLINE = LoggerConfig(mode="online")


def test_no_key_anywhere_is_refused_with_the_three_ways_to_fix_it(tmp_path):
    with pytest.raises(ConfigError) as refused:
        check_wandb_key(ONLINE, {"HOME": str(tmp_path)})
    assert (
        str(refused.value)
        == NO_KEY
        == (
            "logger.mode=online needs a wandb API key: run `wandb login`, set WANDB_API_KEY, or use logger.mode=offline"
        )
    )
    with pytest.raises(ConfigError):
        check_wandb_key(ONLINE, {})  # no HOME at all


@pytest.mark.parametrize(
    "environ",
    [
        {"WANDB_API_KEY": "k" * 40},
        {"WANDB_IDENTITY_TOKEN_FILE": "/some/token"},
    ],
)
def test_a_key_in_the_environment_passes(tmp_path, environ):
    check_wandb_key(ONLINE, {"HOME": str(tmp_path), **environ})


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_wandb_mode_in_the_environment_does_not_stand_in_for_a_key(tmp_path, mode):
    """wandb.init(mode="online") overrides WANDB_MODE and still asks for a key (wandb 0.31)."""
    with pytest.raises(ConfigError):
        check_wandb_key(ONLINE, {"HOME": str(tmp_path), "WANDB_MODE": mode})


def test_offline_and_disabled_need_no_key(tmp_path):
    for mode in ("offline", "disabled"):
        check_wandb_key(LoggerConfig(mode=mode), {"HOME": str(tmp_path)})


def test_the_netrc_entry_wandb_login_writes_is_found_for_the_servers_host(tmp_path):
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert has_wandb_key({"HOME": str(tmp_path)})
    assert not has_wandb_key({"HOME": str(tmp_path), "WANDB_BASE_URL": "https://wandb.example.com"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("machine wandb.example.com login user password secret\n")
    assert has_wandb_key({"NETRC": str(elsewhere), "WANDB_BASE_URL": "https://wandb.example.com"})
    (tmp_path / ".netrc").write_text("machine github.com login user password other\n")
    assert not has_wandb_key({"HOME": str(tmp_path)})
    (tmp_path / ".netrc").write_text("this is not ( a netrc\n")
    assert not has_wandb_key({"HOME": str(tmp_path)})  # wandb warns and finds no key either


def test_an_api_key_in_wandbs_settings_file_is_found(tmp_path):
    settings = tmp_path / ".config" / "wandb" / "settings"
    settings.parent.mkdir(parents=True)
    settings.write_text("[default]\nentity = me\n")
    assert not has_wandb_key({"HOME": str(tmp_path)})
    settings.write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert has_wandb_key({"HOME": str(tmp_path)})


@pytest.mark.slow  # python run.py: hydra and torch imports (~4 s)
def test_run_py_online_without_a_key_fails_in_one_line_before_any_worker_starts(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ("NETRC", "HOME")}
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={run_dir}", "logger.mode=online"],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**environ, "HOME": str(home)},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: {NO_KEY}"
    assert not (run_dir / "logs").exists() and not (run_dir / "job.json").exists()
