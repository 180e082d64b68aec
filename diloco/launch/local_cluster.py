"""The embedded launcher: a lighthouse plus M replica groups x N worker processes on this machine.

Each worker is a real process with torchrun's environment, so what runs here is what runs
under torchrun or Slurm on many hosts; only the spawning differs (diloco.spawn: workers and
the lighthouse forked from a warm fork server, or exec'd). ``LocalCluster`` owns the processes, so a test or a fault
injector can kill, stop and restart any part of the job, and every one of them watches the
launcher's lifeline (diloco.lifeline): none outlives the launcher, however it ends.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from diloco.config.base import to_dict
from diloco.config.job import JobConfig
from diloco.exits import REFUSED_PREFIX
from diloco.files import writing
from diloco.ft.fault_requests import request_fault
from diloco.launch.spawn import (
    ForkedProcess,
    ForkServer,
    ForkServerError,
    ForkServerGone,
    ForkServerSilent,
    ProcessHandle,
    WorkerSpec,
    exec_lighthouse,
    exec_worker,
)
from diloco.lifeline import Lifeline
from diloco.run_paths import RunPaths
from diloco.stopped_watch import JOB_CONTROL_STOP, process_state
from diloco.train.block_wrappers import will_run_on_cpu
from diloco.train.flops import Peak, launcher_cpu_peak
from diloco.worker.env import WorkerEnv
from diloco.worker.spares import Assignment, assign, make_pipes

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
TERMINATE_GRACE_S = 10.0
LOG_TAIL_LINES = 20
START_BACKOFF_S = 0.5  # before a fork server or lighthouse killed or stopped as the job starts is replaced, doubling
MAX_START_BACKOFF_S = 8.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the lighthouse is never behind a proxy


class JobFailed(RuntimeError):
    """A process of the job failed; the message carries the end of its log."""


@dataclass
class WorkerProcess:
    group: int | None  # None: a worker of a warm spare not yet assigned
    rank: int
    process: ProcessHandle
    log_path: Path


@dataclass
class Spare:
    """A warm spare (diloco.worker.spares): a group's worth of built workers waiting for a group to replace."""

    index: int
    workers: list[WorkerProcess]
    pipes: list[Path]

    def dead(self) -> bool:
        return any(w.process.poll() is not None for w in self.workers)


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORT_TRIES = 64


class StartBackoff:
    """The waits before a process killed or stopped as it started is replaced: from
    ``START_BACKOFF_S``, doubling to ``MAX_START_BACKOFF_S``, for up to ``cluster.timeouts.launch``."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s, self.deadline = limit_s, time.monotonic() + limit_s
        self.wait_s, self.failures = START_BACKOFF_S, 0

    def give_up(self) -> bool:
        """Count a failure; whether the next try, after the wait, would be past the deadline."""
        self.failures += 1
        return time.monotonic() + self.wait_s > self.deadline

    def sleep(self) -> None:
        time.sleep(self.wait_s)
        self.wait_s = min(2 * self.wait_s, MAX_START_BACKOFF_S)

    def failures_said(self) -> str:
        return f"{self.failures} times within cluster.timeouts.launch={self.limit_s:g}s"


def free_port(host: str, ephemeral: Path = EPHEMERAL_PORTS) -> int:
    """A port free now, below the kernel's ephemeral range where one is: the lighthouse (or a
    group's store) binds it a second or more later, and meanwhile any outgoing connection may
    take a port of that range (a busy machine's did: "Address already in use"), while a port
    outside it only an explicit bind takes. Else one the OS picks."""
    low = _ephemeral_low(ephemeral)
    chooser = random.SystemRandom()  # a job's seeded `random` must not make two launchers pick alike
    candidates = range(max(1024, low - 16384), low)
    for port in chooser.sample(candidates, min(PORT_TRIES, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low(ephemeral: Path) -> int:
    """The first port of the kernel's ephemeral range, or 1024 (no room below it) where unknown."""
    try:
        return int(ephemeral.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 1024


def threads_per_worker(total_workers: int) -> int:
    """Split ``usable_cores`` between the workers so they do not oversubscribe them."""
    return max(1, usable_cores() // total_workers)


def usable_cores() -> int:
    """The cores this process may run on: its affinity (a Slurm or taskset share), not the whole machine's."""
    return len(os.sched_getaffinity(0))


def resolve_lighthouse(job: JobConfig) -> JobConfig:
    """Fill in what a local job leaves open: a free port and a fresh secret token."""
    lighthouse = job.cluster.lighthouse
    lighthouse = dataclasses.replace(
        lighthouse,
        port=lighthouse.port or free_port(lighthouse.host),
        token=lighthouse.token or secrets.token_hex(16),
    )
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, lighthouse=lighthouse))


def serving_pid(url: str) -> int | None:
    """The pid the lighthouse at ``url`` reports on /alive (None: nothing there answers as a lighthouse)."""
    try:
        with _NO_PROXY.open(url + "/alive", timeout=1.0) as response:
            return int(json.loads(response.read())["pid"])
    except (OSError, ValueError, KeyError, TypeError):  # refused, reset, timeout, not a lighthouse
        return None


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def crash_report(path: Path) -> str:
    """What ends a failure's message: the exception the process died of (so the first line, which
    the summary keeps, names the cause), then the last lines of its log."""
    died_of = last_exception(path)
    cause = f"last error: {died_of}; " if died_of else ""
    return f"{cause}last lines of {path}:\n{log_tail(path)}"


def last_exception(path: Path, ignoring: str | None = None) -> str | None:
    """The ``Type: message`` line of the last Python traceback in a log, if there is one; with
    ``ignoring``, of the last whose line does not contain it (torchrun's own report of a failed worker)."""
    lines = _log_lines(path)
    raised = [
        next((line for line in lines[i + 1 :] if line and not line[0].isspace()), None)
        for i, line in enumerate(lines)
        if line.startswith("Traceback (most recent call last):")
    ]
    if ignoring is None:
        return raised[-1] if raised else None
    return next((line for line in reversed(raised) if line and ignoring not in line), None)


def refusal(path: Path) -> str | None:
    """The one line a worker that refused the job's configuration wrote last (``REFUSED_PREFIX`` cut), if any."""
    lines = reversed(_log_lines(path))
    return next((line.removeprefix(REFUSED_PREFIX) for line in lines if line.startswith(REFUSED_PREFIX)), None)


def _log_lines(path: Path) -> list[str]:
    """A log's lines; none when it cannot be read (a worker that died before writing it)."""
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def logs_tail(logs: Path, lines: int) -> str:
    """The last ``lines`` of every log of a job, each under its file name."""
    return "\n".join(f"--- {p.name}\n{log_tail(p, lines)}" for p in sorted(logs.glob("*.log")))


def wait_until(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    poll_s: float = 0.2,
    gone: Callable[[], str | None] = lambda: None,
) -> float:
    """Poll until ``condition()`` holds; the seconds it took. For whoever drives a job from outside
    (a test, a benchmark): ``gone()`` names why the condition can no longer come (a process died),
    ending the wait at once instead of after the whole timeout."""
    start = time.monotonic()
    while not condition():
        if (reason := gone()) is not None:
            raise JobFailed(f"while waiting for {what}: {reason}")
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


def _kill_and_reap(processes: list[ProcessHandle]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def stop_processes(processes: list[ProcessHandle]) -> None:
    """SIGTERM (and SIGCONT, in case one is stopped), then SIGKILL what is left after a grace period."""
    for process in terminate_and_wait(processes, TERMINATE_GRACE_S):
        process.kill()
        process.wait()


def terminate_and_wait(processes: list[ProcessHandle], timeout_s: float) -> list[ProcessHandle]:
    """SIGTERM (and SIGCONT, in case one is stopped) to each, then wait up to ``timeout_s`` in all;
    returns those still running."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
            process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + timeout_s
    running = []
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            running.append(process)
    return running


class LocalCluster:
    """The processes of one job on this machine: a lighthouse and every group's workers.

    ``worker_prefix``: per group, a command its workers run under (``ip netns exec NS``: the
    group in its own network namespace, experiments/communication/netns_link.py). Only exec'd workers can
    (a fork server's children share its namespace), and no spare (it serves any group).
    """

    def __init__(
        self, job: JobConfig, paths: RunPaths, signature: str, worker_prefix: Mapping[int, Sequence[str]] | None = None
    ) -> None:
        if worker_prefix and (job.cluster.spawn != "exec" or job.cluster.spares):
            raise ValueError(
                f"a per-group worker prefix needs cluster.spawn=exec and cluster.spares=0, "
                f"got spawn={job.cluster.spawn}, spares={job.cluster.spares}"
            )
        self.worker_prefix = {g: tuple(p) for g, p in (worker_prefix or {}).items()}
        self.job = resolve_lighthouse(job)
        self.paths = paths
        self.signature = signature
        self.lighthouse: ProcessHandle | None = None
        self.groups: dict[int, list[WorkerProcess]] = {}
        self.spares: list[Spare] = []
        self._spares_started = 0
        self.lifeline: Lifeline | None = None  # made when the first process starts, cut by stop()
        self.fork_server: ForkServer | None = None  # started by the first process started with cluster.spawn=fork
        paths.logs.mkdir(parents=True, exist_ok=True)
        with writing(paths.job):  # a full disk: OutputError naming job.json
            paths.job.touch(mode=0o600)  # it holds the token: only its owner may read it
            paths.job.write_text(json.dumps(to_dict(self.job), indent=2))

    @property
    def lighthouse_url(self) -> str:
        return self.job.cluster.lighthouse.url()

    def _lifeline(self) -> Lifeline:
        if self.lifeline is None:
            self.lifeline = Lifeline()
        return self.lifeline

    def start_lighthouse(self) -> None:
        """Start the lighthouse and wait (bounded by the connect timeout) until it serves.

        Its /alive must name its own pid: another process already listening on a fixed port
        (a lighthouse left from another job, say) is never taken for this job's. With
        ``cluster.spawn=fork`` it is forked from the fork server (a restart costs a fork, not
        seconds of imports while no group has a quorum); the first call starts that server.
        One killed or stopped (SIGSTOP) before it served is a fault like any other, at the job's
        start too: it is replaced after a backoff, for up to ``cluster.timeouts.launch``.
        """
        backoff = StartBackoff(self.job.cluster.timeouts.launch)
        while (fault := self._start_lighthouse_once()) is not None:
            if backoff.give_up():
                raise JobFailed(f"the lighthouse was {fault} before it served ({backoff.failures_said()})")
            backoff.sleep()

    def _start_lighthouse_once(self) -> str | None:
        """Start one lighthouse; None once it serves, or the fault that ended it first (it is
        gone then). A cause a fresh one would meet again fails the job."""
        log_path = self.paths.logs / "lighthouse.log"
        if self.job.cluster.spawn == "exec":
            self.lighthouse = exec_lighthouse(self.paths.root, self.signature, log_path, self._lifeline())
        else:
            timeout_s = self.job.cluster.timeouts.connect
            self.lighthouse = self._fork(lambda server: server.spawn_lighthouse(self.signature, log_path, timeout_s))
        deadline = time.monotonic() + self.job.cluster.timeouts.connect
        while time.monotonic() < deadline:
            if self.lighthouse.poll() is not None:
                if self.lighthouse.returncode < 0:
                    return f"killed ({signal.Signals(-self.lighthouse.returncode).name})"
                last = log_tail(log_path, 1)
                raise JobFailed(f"the lighthouse could not start at {self.lighthouse_url}: {last}")
            if serving_pid(self.lighthouse_url) == self.lighthouse.pid:
                return None
            if process_state(self.lighthouse.pid) == JOB_CONTROL_STOP:
                self.kill_lighthouse()
                return "stopped (SIGSTOP)"
            time.sleep(0.1)
        raise JobFailed(
            f"the lighthouse did not serve at {self.lighthouse_url} within "
            f"cluster.timeouts.connect={self.job.cluster.timeouts.connect:g}s"
        )

    def kill_lighthouse(self) -> None:
        """A planned outage: the lighthouse is forgotten (not a crash to restart) until started again."""
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait()
            self.lighthouse = None

    def start_group(self, group: int) -> None:
        """Start the N workers of one replica group, each logging to its own file.

        With ``cluster.spawn=fork`` the first call starts the fork server (it imports
        everything once, so this call waits for it), and a call after it died starts another.
        """
        self.groups[group] = self._start_workers(group, None)

    @functools.cached_property
    def worker_peak(self) -> Peak | None:
        """Each CPU worker's peak, measured here just before the first worker starts (no worker
        runs yet; a lighthouse or fork server started before it has done its imports) and handed
        to every worker; None where ``cluster.peak_tflops`` is set or the workers run on GPUs."""
        cluster = self.job.cluster
        if cluster.peak_tflops > 0 or not will_run_on_cpu(cluster.device):
            return None
        workers = cluster.groups * cluster.workers_per_group
        return launcher_cpu_peak(threads_per_worker(workers), workers, usable_cores())

    def start_spare(self) -> Spare:
        """Start a warm spare: N workers that build what any group builds, then wait to replace one."""
        index = self._spares_started
        self._spares_started += 1
        pipes = make_pipes(self.paths, index, self.job.cluster.workers_per_group)
        spare = Spare(index, self._start_workers(None, index), pipes)
        self.spares.append(spare)
        return spare

    def _start_workers(self, group: int | None, spare: int | None) -> list[WorkerProcess]:
        n = self.job.cluster.workers_per_group
        peak = self.worker_peak  # on the first call, measured before these workers' clock starts and port is picked
        port = free_port(self.job.cluster.master_addr)
        # A spare's workers get the cores of the group they replace.
        threads = threads_per_worker(self.job.cluster.groups * n)
        started_at = time.time()
        workers = []
        for rank in range(n):
            env = WorkerEnv(
                rank=rank,
                world_size=n,
                local_rank=rank,
                master_addr=self.job.cluster.master_addr,
                master_port=port,
                peak=peak,
            )
            log_path = self.paths.worker_log(group, rank) if spare is None else self.paths.spare_log(spare, rank)
            prefix = self.worker_prefix.get(group, ()) if spare is None else ()
            spec = WorkerSpec(group, env, threads, log_path, started_at, spare, prefix)
            workers.append(WorkerProcess(group, rank, self._spawn(spec), spec.log_path))
        return workers

    def take_spare(self, group: int) -> int | None:
        """Hand ``group`` to a spare whose every worker is built and waiting; its index, or None if none is.

        From then on its workers are the group's (they log to the group's files).
        """
        for spare in self.spares:
            if not spare.dead() and assign(spare.pipes, Assignment(group, time.time())):
                self.spares.remove(spare)
                self.groups[group] = [
                    WorkerProcess(group, w.rank, w.process, self.paths.worker_log(group, w.rank)) for w in spare.workers
                ]
                return spare.index
        return None

    def remove_dead_spares(self) -> list[Spare]:
        """Spares with a worker that exited (a spare never exits on its own): the rest of each is killed."""
        dead = [spare for spare in self.spares if spare.dead()]
        for spare in dead:
            self.spares.remove(spare)
            _kill_and_reap([w.process for w in spare.workers])
        return dead

    def stop_spares(self) -> None:
        """The job has ended: no group will need one."""
        _kill_and_reap([w.process for spare in self.spares for w in spare.workers])
        self.spares.clear()

    def _spawn(self, spec: WorkerSpec) -> ProcessHandle:
        if self.job.cluster.spawn == "exec":
            return exec_worker(spec, self.paths.root, self._lifeline())
        return self._fork(lambda server: server.spawn(spec, timeout_s=self.job.cluster.timeouts.connect))

    def replace_dead_fork_server(self) -> bool:
        """Start a new fork server as soon as one that served dies, not at the next fork: by the
        next restart it has done its seconds of imports (under chaos, a lighthouse killed after
        the fork server waited for them, and no group had a quorum meanwhile). One that never
        served is left to ``_fork``, whose attempts are bounded: a server that cannot start
        is no restart loop."""
        server = self.fork_server
        if server is None or not server.served or server.alive():
            return False
        self.fork_server = ForkServer.start(self.paths.root, self._lifeline(), self.paths.logs / "forkserver.log")
        return True

    def _fork(self, request: Callable[[ForkServer], ForkedProcess]) -> ForkedProcess:
        """``request`` a process from the fork server, starting one first if none is alive.

        A server killed between the liveness check and its answer is replaced and asked again, and
        so is one alive that did not answer in time (stopped or stuck: it is killed; the workers
        it forked run on without it): a fault like any other, at the job's start too, ridden with
        a backoff for up to ``cluster.timeouts.launch``. A cause that would repeat fails the job at
        once, saying which: a platform refusal, or a server that exited with an error of its own.
        """
        log_path = self.paths.logs / "forkserver.log"
        backoff = StartBackoff(self.job.cluster.timeouts.launch)
        while True:
            try:
                if self.fork_server is None or not self.fork_server.alive():
                    self.fork_server = ForkServer.start(self.paths.root, self._lifeline(), log_path)
                return request(self.fork_server)
            except ForkServerError as error:
                code = self.fork_server.process.poll() if self.fork_server is not None else None
                if not isinstance(error, (ForkServerGone, ForkServerSilent)):
                    raise JobFailed(f"{error}; {crash_report(log_path)}") from error
                if code is not None and code > 0:  # it failed by itself, not killed: a fresh one would too
                    raise JobFailed(
                        f"{error}: it exited with code {code}, a cause a fresh one would meet again; "
                        f"{crash_report(log_path)}"
                    ) from error
                if backoff.give_up():
                    raise JobFailed(f"{error} ({backoff.failures_said()}); {crash_report(log_path)}") from error
                if isinstance(error, ForkServerSilent):
                    self.fork_server.kill_hung()
                self.fork_server = None
                backoff.sleep()

    def signal_group(self, group: int, signum: int) -> None:
        """Send ``signum`` to every worker of ``group`` (SIGKILL, SIGSTOP, SIGCONT, SIGUSR1...).

        A killed group is forgotten (it is not a failure of the job) until it is started again.
        """
        for w in self.groups[group]:
            if w.process.poll() is None:
                w.process.send_signal(signum)
        if signum == signal.SIGKILL:
            for w in self.groups.pop(group):
                w.process.wait()

    def nap(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking as soon as the fork server reports a process's exit
        (a dead group is then replaced at once instead of at the next poll)."""
        if self.fork_server is not None and self.fork_server.alive():
            self.fork_server.wait_for_answer(timeout_s)
        else:
            time.sleep(timeout_s)

    def request_fault(self, group: int, fault: str) -> None:
        """Make ``group`` inject ``fault`` into its next round (see FaultHook; needs ``faults.in_workers``)."""
        request_fault(self.paths.fault_requests(group), fault)

    def failed_worker(self) -> WorkerProcess | None:
        """A worker that exited with an error, if any."""
        for workers in self.groups.values():
            for w in workers:
                if w.process.poll() not in (None, 0):
                    return w
        return None

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> float:
        """``wait_until`` ``condition`` holds, failing at once if a worker fails; the seconds it took.
        A timeout's error ends with the tail of every log of the job."""
        try:
            return wait_until(condition, timeout_s, what, poll_s, self._failed_worker_tail)
        except TimeoutError as error:
            raise TimeoutError(f"{error}\n{logs_tail(self.paths.logs, 15)}") from None

    def _failed_worker_tail(self) -> str | None:
        failed = self.failed_worker()
        return None if failed is None else f"group {failed.group} died:\n{log_tail(failed.log_path, 40)}"

    def finished(self) -> bool:
        return all(w.process.poll() == 0 for workers in self.groups.values() for w in workers)

    def stop_planned(self, timeout_s: float) -> bool:
        """Ask every worker for a planned stop (SIGTERM: each group stops after its current round,
        saving its state) and wait up to ``timeout_s`` for all of them to exit; True if they did.
        The lighthouse stays up meanwhile: the groups' last round needs it."""
        return not terminate_and_wait([w.process for group in self.groups.values() for w in group], timeout_s)

    def stop(self) -> None:
        """Stop every process of the job; nothing is left behind.

        Cutting the lifeline last also ends any process a failed start left unrecorded.
        """
        self.stop_spares()
        # SIGTERM would ask a worker for a planned stop (stop_planned); this is at once.
        _kill_and_reap([w.process for group in self.groups.values() for w in group])
        stop_processes([self.lighthouse] if self.lighthouse else [])
        if self.fork_server is not None:
            self.fork_server.stop(TERMINATE_GRACE_S)
        if self.lifeline is not None:
            self.lifeline.cut()
            self.lifeline = None
