"""How the launcher starts a worker or the lighthouse: forked from a warm fork server, or exec'd as a fresh python.

``cluster.spawn=fork`` (the default) asks ``diloco.launch.forkserver`` for each worker and for the
lighthouse: a restart then costs a fork instead of seconds of imports. The launcher becomes a
child subreaper, so processes whose fork server died (whoever killed it) are re-parented to
the launcher and keep running, and their exit status is still read. ``cluster.spawn=exec``
starts ``python -m diloco.worker`` per worker and ``python -m diloco.launch.lighthouse_process`` for the lighthouse.
Either way every process watches the launcher's lifeline.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.lifeline import Lifeline
from diloco.stopped_watch import process_state
from diloco.worker.env import WorkerEnv

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
WAIT_POLL_S = 0.02
# A fork server reports a child's exit within its reap interval (50 ms); a death unreported for
# this long means the server is stopped or stuck.
UNREPORTED_DEATH_S = 5.0
# A server stopped (SIGSTOP) this long while asked is given up at once, not after the connect
# timeout, which is for one still importing: meanwhile the supervisor restarts no other group.
STOPPED_SERVER_S = 1.0


class ForkServerError(RuntimeError):
    """The fork server could not start a worker or the lighthouse; the message says why."""


class ForkServerGone(ForkServerError):
    """The fork server exited (killed, say) before it answered: a fresh one may be asked again."""


class ForkServerSilent(ForkServerError):
    """The fork server is alive but did not answer in time (stopped or stuck): once it is
    killed, a fresh one may be asked again."""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its place in its group, its share of the cores, its log."""

    group: int | None  # None: a worker of warm spare ``spare``, which waits for the group it replaces
    env: WorkerEnv
    threads: int
    log_path: Path
    started_at: float  # when the launcher asked for it (fault requests before it were meant for an earlier worker)
    spare: int | None = None
    # A command the exec'd worker runs under (``ip netns exec NS ...``: a group in its own
    # network namespace behind a shaped link, experiments/communication/netns_link.py); it must exec, keeping the pid.
    prefix: tuple[str, ...] = ()

    def place_args(self) -> list[str]:
        """``diloco.worker.entry``'s arguments naming where this worker belongs."""
        return ["--group", str(self.group)] if self.spare is None else ["--spare", str(self.spare)]

    def describe(self) -> str:
        place = f"group {self.group}" if self.spare is None else f"spare {self.spare}"
        return f"worker {self.env.rank} of {place}"


def exec_worker(spec: WorkerSpec, run_dir: Path, lifeline: Lifeline) -> subprocess.Popen:
    """Start ``python -m diloco.worker`` for ``spec``: a fresh interpreter that imports everything itself."""
    argv = [*spec.prefix, sys.executable, "-m", "diloco.worker", "--run-dir", str(run_dir), *spec.place_args()]
    with spec.log_path.open("ab") as log_file:
        return subprocess.Popen(
            [*argv, "--started-at", str(spec.started_at), *lifeline.argv()],
            env={**os.environ, **spec.env.to_environ(), "OMP_NUM_THREADS": str(spec.threads), "PYTHONUNBUFFERED": "1"},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            pass_fds=(lifeline.read_fd,),
            start_new_session=True,  # the launcher alone decides when its workers stop
        )


def exec_lighthouse(run_dir: Path, signature: str, log_path: Path, lifeline: Lifeline) -> subprocess.Popen:
    """Start ``python -m diloco.launch.lighthouse_process`` for the job in ``run_dir``: a fresh interpreter that imports everything itself."""
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "diloco.launch.lighthouse_process",
                "--run-dir",
                str(run_dir),
                "--signature",
                signature,
                *lifeline.argv(),
            ],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            pass_fds=(lifeline.read_fd,),
            start_new_session=True,
        )


class ForkedProcess:
    """A worker or lighthouse forked by a fork server, with the part of ``Popen``'s interface the launcher uses.

    Its exit code comes from the server's report; once that server is gone the process is
    this process's child (we are its subreaper) and ``waitpid`` reads it. A pid is never
    probed with ``kill(pid, 0)``, which would take a zombie for a live process.
    """

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.args = f"process {pid} forked by fork server {server.process.pid}"
        self.returncode: int | None = None
        self._server = server
        self._dead_since: float | None = None  # when it was first seen dead with no report

    def exited(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.read_answers()
        if self.returncode is None and not self._server.gone and self._death_unreported():
            self._server.kill_hung()  # its children, this one included, become ours to reap
        if self.returncode is None and self._server.gone:
            self._reap_orphan()
        return self.returncode

    def _death_unreported(self) -> bool:
        """Dead (a zombie its server has not reaped) for ``UNREPORTED_DEATH_S``: the server, which
        reports an exit within milliseconds, is stopped or stuck, and nobody would learn of it."""
        if process_state(self.pid) != "Z":
            return False  # alive, or reaped (None): its report is on the way
        now = time.monotonic()
        self._dead_since = self._dead_since if self._dead_since is not None else now
        return now - self._dead_since > UNREPORTED_DEATH_S

    def _reap_orphan(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return  # not re-parented yet: the kernel closes a dying server's pipes before it hands its children on
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(WAIT_POLL_S)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # it exited and was reaped since the poll: its report is on the way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


ProcessHandle = subprocess.Popen | ForkedProcess


class ForkServer:
    """The launcher's end of one ``diloco.launch.forkserver`` process: requests in, pids and exit codes out."""

    def __init__(self, process: subprocess.Popen) -> None:
        """Wrap a started server whose stdin and stdout are pipes (``start`` makes one)."""
        self.process = process
        self.gone = False  # its answers reached EOF: it exited, and its children are ours now
        self.served = False  # it started a process: its imports worked
        self._answers_fd = process.stdout.fileno()
        os.set_blocking(self._answers_fd, False)  # polls read what is there and never wait
        self._partial = b""
        self._next_id = 0
        self._started: dict[int, ForkedProcess] = {}  # by request id, until _request() picks it up
        self._children: dict[int, ForkedProcess] = {}  # by pid, until its exit is reported

    @classmethod
    def start(cls, run_dir: Path, lifeline: Lifeline, log_path: Path) -> ForkServer:
        """Start a fork server for the job in ``run_dir``; it imports and loads in the background."""
        if not sys.platform.startswith("linux"):
            raise ForkServerError(
                f"cluster.spawn=fork needs Linux (a child subreaper keeps the exit status of workers whose "
                f"fork server died); this is {sys.platform}: use cluster.spawn=exec"
            )
        become_subreaper()
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "diloco.launch.forkserver", "--run-dir", str(run_dir), *lifeline.argv()],
                # One thread: libgomp and OpenBLAS read this when they load and start no pool.
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                pass_fds=(lifeline.read_fd,),
                start_new_session=True,
            )
        return cls(process)

    def alive(self) -> bool:
        self.read_answers()
        return not self.gone and self.process.poll() is None

    def spawn(self, spec: WorkerSpec, timeout_s: float) -> ForkedProcess:
        """Ask for one worker and wait (up to ``timeout_s``, the server may still be importing) for its pid."""
        place = {"group": spec.group} if spec.spare is None else {"spare": spec.spare}
        request = {
            "role": "worker",
            **place,
            "rank": spec.env.rank,
            "env": spec.env.to_environ(),
            "threads": spec.threads,
            "log": str(spec.log_path),
            "started_at": spec.started_at,
        }
        return self._request(request, spec.describe(), timeout_s)

    def spawn_lighthouse(self, signature: str, log_path: Path, timeout_s: float) -> ForkedProcess:
        """Ask for the lighthouse of this server's job and wait (up to ``timeout_s``) for its pid."""
        request = {"role": "lighthouse", "signature": signature, "log": str(log_path)}
        return self._request(request, "the lighthouse", timeout_s)

    def _request(self, fields: dict[str, Any], what: str, timeout_s: float) -> ForkedProcess:
        """Send one request; wait for the pid of the child it started (``what`` names it in errors)."""
        request_id, self._next_id = self._next_id, self._next_id + 1
        request = {"id": request_id, **fields}
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it exited: reading its answers to the end says so, after its last exit reports
        deadline = time.monotonic() + timeout_s
        stopped_since = None
        while request_id not in self._started:
            if self.gone:
                raise ForkServerGone(f"the fork server exited before it started {what}")
            now = time.monotonic()
            if deadline <= now:
                raise ForkServerSilent(
                    f"the fork server did not start {what} within {timeout_s:.0f}s "
                    "(cluster.timeouts.connect); raise it on a loaded machine"
                )
            stopped = process_state(self.process.pid) in ("T", "t")
            if not stopped:
                stopped_since = None
            elif stopped_since is None:
                stopped_since = now
            if stopped_since is not None and now - stopped_since >= STOPPED_SERVER_S:
                raise ForkServerSilent(f"the fork server was stopped (SIGSTOP) before it started {what}")
            select.select([self._answers_fd], [], [], min(deadline - now, STOPPED_SERVER_S / 4))
            self.read_answers()
        return self._started.pop(request_id)

    def wait_for_answer(self, timeout_s: float) -> None:
        """Block until the server writes something (an exit report, say) or ``timeout_s`` passes."""
        select.select([self._answers_fd], [], [], timeout_s)

    def read_answers(self) -> None:
        """Take in every answer written so far, without blocking; notice when the server is gone."""
        while not self.gone:
            try:
                chunk = os.read(self._answers_fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                self.gone = True
                return
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for line in filter(None, lines):
                self._take(json.loads(line))

    def _take(self, answer: dict) -> None:
        if "exited" in answer:
            self._children.pop(answer["exited"]).exited(answer["code"])
        else:  # registered at once: its exit may be reported in the same read
            self.served = True
            child = ForkedProcess(answer["pid"], self)
            self._children[child.pid] = child
            self._started[answer["id"]] = child

    def kill_hung(self) -> None:
        """Kill a server that stopped answering (SIGSTOP, stuck): its children run on, re-parented
        to this process (their subreaper), which reads their exits from now on."""
        self.process.kill()
        self.process.wait()
        self.read_answers()

    def stop(self, timeout_s: float) -> None:
        """Close its requests (it kills what it still runs and exits); kill it if it does not."""
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass  # already gone
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.read_answers()


def become_subreaper() -> None:
    """Adopt the orphans of this process's descendants (Linux ``PR_SET_CHILD_SUBREAPER``).

    The workers of a fork server that died are then re-parented here instead of to init, so
    they keep running and their exit status can be read with ``waitpid``. It holds for the
    life of this process; other orphans it adopts stay zombies until it exits.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(errno)}")
