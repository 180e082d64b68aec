"""The job's token stays secret (docs/design.md, invariant 8): read from a file or the environment, never
given on the command line, and in no log, saved config, hydra file or wandb file of a run; a
lighthouse listening beyond loopback requires one."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from diloco.config.base import ConfigError
from diloco.config.redaction import REDACTED, TOKEN_ENV, redacted
from diloco.launch.job_token import token_problem_on_command_line, with_job_token
from tests.conftest import FAST, REPO, compose_job

TOKEN = "9f86d081884c7d659a2feaa0c55ad015"  # what a token looks like: no word a log would hold by chance


@pytest.mark.parametrize(
    "argv",
    [
        ["role=lighthouse", f"cluster.lighthouse.token={TOKEN}"],
        [f"+cluster.lighthouse.token={TOKEN}"],
        [f"++cluster.lighthouse.token={TOKEN}"],
        ["-m", f"cluster.lighthouse.token={TOKEN},other"],
        [f"cluster.lighthouse={{host: 0.0.0.0, token: {TOKEN}}}"],
        [f"cluster={{lighthouse: {{token: {TOKEN}}}}}"],
    ],
    ids=["plain", "plus", "plus-plus", "sweep", "mapping", "nested-mapping"],
)
def test_a_token_on_the_command_line_is_refused_in_one_line_naming_the_ways_to_give_it(argv):
    problem = token_problem_on_command_line(argv)
    assert problem and "\n" not in problem and TOKEN not in problem
    assert "cluster.lighthouse.token_file=PATH" in problem and TOKEN_ENV in problem


def test_the_command_line_may_name_a_token_file_or_leave_the_token_empty():
    for arg in ("cluster.lighthouse.token_file=/run/secrets/job", "cluster.lighthouse.token=", "name=token"):
        assert token_problem_on_command_line([arg]) is None, arg
    for empty in ("''", '""', "null"):
        assert token_problem_on_command_line([f"cluster.lighthouse.token={empty}"]) is None, empty
    assert token_problem_on_command_line(["cluster.lighthouse={token_file: /run/secrets/job}"]) is None


def test_redacted_hides_a_set_token_and_leaves_the_config_otherwise_alone():
    raw = {"name": "job", "cluster": {"groups": 2, "lighthouse": {"host": "0.0.0.0", "token": TOKEN}}}
    hidden = redacted(raw)
    assert hidden == {"name": "job", "cluster": {"groups": 2, "lighthouse": {"host": "0.0.0.0", "token": REDACTED}}}
    assert raw["cluster"]["lighthouse"]["token"] == TOKEN  # a copy
    assert redacted({"cluster": {"lighthouse": {"token": ""}}}) == {"cluster": {"lighthouse": {"token": ""}}}
    assert redacted({"name": "no cluster"}) == {"name": "no cluster"}


def test_the_token_comes_from_token_file_then_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    group = compose_job(["role=group", f"cluster.lighthouse.token_file={path}"])
    assert with_job_token(group, {TOKEN_ENV: "from-env"}).cluster.lighthouse.token == TOKEN  # the key wins
    lighthouse = compose_job(["role=lighthouse"])
    assert with_job_token(lighthouse, {TOKEN_ENV: f" {TOKEN}\n"}).cluster.lighthouse.token == TOKEN
    assert with_job_token(lighthouse, {}).cluster.lighthouse.token == ""
    summary = compose_job(["role=summary", "cluster.lighthouse.token_file=/no/such/file"])
    assert with_job_token(summary, {}) == summary  # speaks to no lighthouse: reads nothing


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "the file is empty"),
        ("two words", "one line of printable ASCII without spaces"),
        ("a\nb", "one line of printable ASCII without spaces"),
        ("caf\u00e9", "one line of printable ASCII without spaces"),
    ],
    ids=["missing", "empty", "space", "two-lines", "non-ascii"],
)
def test_a_bad_token_file_is_refused_naming_the_key_never_the_content(tmp_path, content, message):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    job = compose_job(["role=lighthouse", f"cluster.lighthouse.token_file={path}"])
    with pytest.raises(ConfigError, match=message) as refused:
        with_job_token(job, {})
    assert str(refused.value).startswith(f"cluster.lighthouse.token_file={path}: ")
    assert content is None or not content or content not in str(refused.value)


def test_a_token_set_in_a_config_file_is_refused(tmp_path):
    """Hydra has saved a copy of it in .hydra/config.yaml by the time the job reads it."""
    job = compose_job([f"cluster.lighthouse.token={TOKEN}"])  # as a conf/ preset would set it
    with pytest.raises(ConfigError, match="set in a config file") as refused:
        with_job_token(job, {})
    assert TOKEN not in str(refused.value)


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def _files_holding(run_dir, secret: str) -> list[str]:
    return sorted(
        str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()
    )


@pytest.mark.slow
@pytest.mark.parametrize("source", ["token_file", "environment"])
def test_a_local_job_with_wandb_keeps_its_token_in_job_json_alone(tmp_path, source):
    """A real job with wandb offline: the token was copied into wandb/debug.log, run-*.wandb and
    logs/debug.log through the config handed to wandb."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    run_dir = tmp_path / "run"
    given = [f"cluster.lighthouse.token_file={token_file}"] if source == "token_file" else []
    fast = [arg for arg in FAST if arg != "logger=none"]
    result = _run(
        [f"hydra.run.dir={run_dir}", *fast, "logger=wandb", "logger.mode=offline", *given],
        env={TOKEN_ENV: TOKEN} if source == "environment" else {},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert TOKEN not in result.stdout + result.stderr
    assert list(run_dir.rglob("*.wandb")), "wandb wrote no offline run: the test would prove nothing"
    assert (run_dir / "status.html").is_file(), "the lighthouse leaves its status page behind"
    assert _files_holding(run_dir, TOKEN) == ["job.json"]
    assert stat.S_IMODE((run_dir / "job.json").stat().st_mode) == 0o600
    assert json.loads((run_dir / "job.json").read_text())["cluster"]["lighthouse"]["token"] == TOKEN  # it was used


@pytest.mark.slow
def test_role_lighthouse_with_a_token_on_the_command_line_is_refused_before_any_file_is_written(tmp_path):
    run_dir = tmp_path / "run"
    result = _run([f"hydra.run.dir={run_dir}", "role=lighthouse", f"cluster.lighthouse.token={TOKEN}"], timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        (
            "error: cluster.lighthouse.token on the command line would be saved in the run directory by hydra; "
            f"put the token in a file and pass cluster.lighthouse.token_file=PATH, or set {TOKEN_ENV}"
        )
    ]
    assert not run_dir.exists() and not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_role_lighthouse_beyond_loopback_without_a_token_is_refused_in_one_line(tmp_path, host):
    result = _run([f"hydra.run.dir={tmp_path}", "role=lighthouse", f"cluster.lighthouse.host={host}"], timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        (
            f"error: cluster.lighthouse.host='{host}': listens beyond loopback, which needs the job's token: put "
            f"it in a file and pass cluster.lighthouse.token_file=PATH (or set {TOKEN_ENV}), or listen on 127.0.0.1"
        )
    ]
    assert not (tmp_path / "config.yaml").exists()
