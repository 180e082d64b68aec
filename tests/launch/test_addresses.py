"""Every address and port a role binds or dials is checked before any process starts or file is
written (diloco/launch/addresses.py), and ``role=group`` without torchrun's variables is refused:
one line naming the key, the value and the fix, never a socket traceback."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys

import pytest

from diloco.config.base import ConfigError
from diloco.config.cluster import LighthouseConfig
from diloco.exits import REFUSED_EXIT_CODE
from diloco.launch.addresses import check_addresses, check_lighthouse_listens
from diloco.launch.local_cluster import free_port
from diloco.train.flops import Peak
from diloco.worker.env import WorkerEnv
from tests.conftest import REPO, compose_job

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster.lighthouse.host=no-such-host.invalid"],
            (
                r"^cluster\.lighthouse\.host=no-such-host\.invalid: does not resolve to an IPv4 address \(.+\); "
                r"check the spelling, or use an IP address$"
            ),
        ),
        (
            ["cluster.master_addr=no-such-host.invalid"],
            r"^cluster\.master_addr=no-such-host\.invalid: does not resolve",
        ),
        (
            ["cluster.master_addr=192.0.2.1"],  # TEST-NET-1: an address no machine of ours has
            (
                r"^cluster\.master_addr=192\.0\.2\.1: cannot listen there \(.+\): not an address of this machine; "
                r"use 127\.0\.0\.1 for a job on this machine"
            ),
        ),
        (["cluster.lighthouse.host=192.0.2.1"], r"^cluster\.lighthouse\.host=192\.0\.2\.1: cannot listen there"),
        (["cluster.master_addr=2001:db8::1"], r"^cluster\.master_addr=2001:db8::1: an IPv6 address; .* use an IPv4"),
        (["cluster.master_addr=::1"], r"^cluster\.master_addr=::1: an IPv6 address"),
        (["cluster.master_addr=''"], r"^cluster\.master_addr='': must be a host name or an IPv4 address"),
        (["cluster.master_addr=999.1.1.1"], r"^cluster\.master_addr=999\.1\.1\.1: does not resolve"),
        (["role=lighthouse", "cluster.lighthouse.host=no-such-host.invalid"], r"^cluster\.lighthouse\.host=no-such"),
        (["role=group", "group.id=0", "cluster.lighthouse.host=no-such-host.invalid"], r"^cluster\.lighthouse\.host="),
        (["role=group", "group.id=0"], r"^cluster\.lighthouse\.port=0: role=group dials the job's lighthouse"),
    ],
)
def test_an_address_a_role_cannot_use_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_addresses(compose_job(["logger=none", *overrides]))
    assert "\n" not in str(refused.value)


def test_addresses_this_machine_has_pass_and_roles_without_sockets_are_not_checked():
    check_addresses(compose_job(["logger=none"]))
    check_addresses(compose_job(["logger=none", "cluster.master_addr=localhost", "cluster.lighthouse.host=localhost"]))
    check_addresses(compose_job(["logger=none", "cluster.master_addr=0.0.0.0"]))
    check_addresses(compose_job(["logger=none", "role=group", "group.id=0", "cluster.lighthouse.port=29999"]))
    check_addresses(compose_job(["logger=none", "role=summary", "cluster.master_addr=no-such-host.invalid"]))


@pytest.mark.parametrize("role", ["local", "lighthouse"])
def test_a_busy_lighthouse_port_is_refused_naming_the_key(role):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as refused:
            check_addresses(compose_job(["logger=none", f"role={role}", f"cluster.lighthouse.port={port}"]))
    assert str(refused.value) == (
        f"cluster.lighthouse.port={port}: cannot listen on 127.0.0.1:{port} (Address already in use); stop what "
        "listens there (another lighthouse?) or pick another cluster.lighthouse.port (0 picks a free one)"
    )


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, r"^missing RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment: role=group"),
        ({**TORCHRUN_ENV, "MASTER_PORT": ""}, r"^missing MASTER_PORT in the environment"),
        ({**TORCHRUN_ENV, "RANK": "zero"}, r"^RANK='zero' in the environment: must be an integer; start the group"),
        ({**TORCHRUN_ENV, "RANK": "1"}, r"^RANK=1 with WORLD_SIZE=1: the rank must be in \[0, WORLD_SIZE\)"),
    ],
)
def test_torchruns_variables_missing_or_malformed_are_a_config_error(environ, message):
    with pytest.raises(ConfigError, match=message):
        WorkerEnv.from_environ(environ)
    assert WorkerEnv.from_environ(TORCHRUN_ENV).master_port == 29500


def test_the_peak_the_launcher_measured_reaches_the_worker_beside_torchruns_variables():
    env = WorkerEnv.from_environ(TORCHRUN_ENV)
    assert env.peak is None  # under torchrun: nobody measured for it
    handed = dataclasses.replace(env, peak=Peak(0.05, "measured once by the launcher"))
    assert WorkerEnv.from_environ(handed.to_environ()) == handed


def _run(args: list[str], run_dir, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={run_dir}", "logger=none", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**environ, **(env or {})},
    )


@pytest.mark.slow  # python run.py: hydra and torch imports (~4 s each)
@pytest.mark.parametrize(
    "args",
    [["cluster.master_addr=192.0.2.1"], ["cluster.lighthouse.host=no-such-host.invalid"]],
)
def test_run_py_refuses_a_bad_address_before_it_starts_or_writes_anything(tmp_path, args):
    result = _run(args, tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {args[0]}: ")
    assert not (tmp_path / "job.json").exists() and not (tmp_path / "config.yaml").exists()
    assert not (tmp_path / "logs").exists() and not (tmp_path / "launcher.lock").exists()


@pytest.mark.slow
def test_role_lighthouse_on_a_busy_port_says_so_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run(["role=lighthouse", f"cluster.lighthouse.port={port}"], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: cluster.lighthouse.port={port}: cannot listen on 127.0.0.1:{port} (Address already in use); "
        )
    )
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_role_group_without_torchruns_variables_says_so_in_one_line(tmp_path):
    port = free_port("127.0.0.1")
    result = _run(["role=group", "group.id=0", f"cluster.lighthouse.port={port}"], tmp_path)
    assert result.returncode == REFUSED_EXIT_CODE and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: missing RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment: role=group runs "
        "one worker of a replica group and expects torchrun's variables "
        "(torchrun --nproc-per-node N run.py role=group ...)"
    )
    assert not (tmp_path / "config.yaml").exists()


def test_a_picked_port_lies_below_the_ephemeral_range_that_outgoing_connections_take(tmp_path):
    """The launcher picks the lighthouse's port a second or more before the lighthouse binds it;
    a port of the ephemeral range was taken meanwhile by a busy machine's outgoing connection
    ("Address already in use", a CI run beside a training job)."""
    kernel = tmp_path / "ip_local_port_range"
    kernel.write_text("32768\t60999\n")
    assert all(32768 - 16384 <= free_port("127.0.0.1", kernel) < 32768 for _ in range(8))
    kernel.write_text("1024\t65535\n")  # no room below the range: the OS picks, as without the file
    assert 1024 < free_port("127.0.0.1", kernel) <= 65535
    assert 1024 < free_port("127.0.0.1", tmp_path / "no such file") <= 65535


def test_a_group_waits_for_its_lighthouse_to_listen_and_names_the_address_when_none_does():
    """Checked before the model is built: a wrong port costs one cluster.timeouts.connect."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_lighthouse_listens(LighthouseConfig(host="127.0.0.1", port=listening.getsockname()[1]), 5)
    port = free_port("127.0.0.1")
    with pytest.raises(ConfigError) as refused:
        check_lighthouse_listens(LighthouseConfig(host="127.0.0.1", port=port), 0.6)
    assert str(refused.value).startswith(
        f"cannot reach the lighthouse at 127.0.0.1:{port} within cluster.timeouts.connect=0.6s ("
    ) and str(refused.value).endswith(
        "check cluster.lighthouse.host and cluster.lighthouse.port, and that role=lighthouse runs there"
    )
