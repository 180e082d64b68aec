"""Shared by the library's tests: a lighthouse on loopback, and replica groups of one's own loop
run as subprocesses, each bounded by a timeout."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from diloco.config.base import to_dict
from diloco.config.cluster import LighthouseConfig, QuorumRules
from diloco.ft.lighthouse import Lighthouse
from diloco.launch.local_cluster import threads_per_worker
from tests.conftest import FAST, REPO, compose_job

PROJECT_LOOP = REPO / "tests" / "library" / "project_loop.py"

# Two groups of one worker on the CPU, 40 inner steps in 4 rounds: seconds on two cores.
SMALL = [
    *FAST,
    "cluster.groups=2",
    "cluster.workers_per_group=1",
    "cluster.device=cpu",
    "trainer.max_steps=40",
    "algo.sync_every=10",
]

# A job of two groups whose silent group is dropped after the job's default 3 s of no heartbeat;
# tests that leave a group out for good shorten end_timeout_s (the finished wait that long for it).
QUICK_RULES = QuorumRules(
    min_groups=1,
    join_timeout_s=0.5,
    heartbeat_timeout_s=3.0,
    expected_groups=2,
    start_timeout_s=60.0,
    end_timeout_s=60.0,
    sit_out_s=60.0,
)


def write_job(path: Path, overrides: list[str]) -> Path:
    """The job ``python run.py *overrides`` would run, as the job.json ``project_loop.py`` reads."""
    path.write_text(json.dumps(to_dict(compose_job(overrides))))
    return path


@pytest.fixture
def lighthouse() -> Iterator[Callable[..., Lighthouse]]:
    """A factory: ``lighthouse(rules, **changes)`` serves a job named ``diloco`` (``DiLoCo``'s default) on
    127.0.0.1 at a free port, in this process, until the test ends."""
    started: list[Lighthouse] = []

    def start(rules: QuorumRules = QUICK_RULES, job: str = "diloco", **changes: float) -> Lighthouse:
        server = Lighthouse(LighthouseConfig(), dataclasses.replace(rules, **changes), job)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@dataclass
class GroupProcess:
    """One replica group's process; its output goes to a file (a pipe nobody reads could fill)."""

    group: int
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        """Its exit code; killed (and the test failed) if it outlasts ``timeout_s``."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"group {self.group} took over {timeout_s}s:\n{self.output()[-8000:]}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.output().splitlines() if line.startswith(prefix)]


@pytest.fixture
def start_group(tmp_path: Path) -> Iterator[Callable[..., GroupProcess]]:
    """A factory: ``start_group(group, lighthouse_url, *argv)`` runs ``python *argv`` as replica
    group ``group`` (``DILOCO_GROUP``, ``DILOCO_LIGHTHOUSE``), with as many threads as the local
    launcher gives each of two workers (their matmuls then sum in the same order). Every process
    still running when the test ends is killed."""
    started: list[GroupProcess] = []

    def start(group: int, lighthouse_url: str, *argv: str | Path, env: dict[str, str] | None = None) -> GroupProcess:
        log = tmp_path / f"group{group}.{len(started)}.log"
        environ = (
            os.environ
            | {
                "DILOCO_GROUP": str(group),
                "DILOCO_LIGHTHOUSE": lighthouse_url,
                "OMP_NUM_THREADS": str(threads_per_worker(2)),
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            }
            | (env or {})
        )
        environ.pop("DILOCO_RUN_DIR", None)
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, *map(str, argv)], cwd=REPO, env=environ, stdout=out, stderr=subprocess.STDOUT
            )
        started.append(GroupProcess(group, process, log))
        return started[-1]

    yield start
    for group in started:
        group.kill()
