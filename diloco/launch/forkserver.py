"""``python -m diloco.launch.forkserver --run-dir DIR --lifeline-fd N``: forks warm workers and lighthouses on request.

A fresh ``python -m diloco.worker`` spends seconds of CPU importing torch and reading the
corpus before it can heal; on a two-core machine that is most of a group's restart. A fresh
``python -m diloco.launch.lighthouse_process`` spends as long importing before it serves, and no group has a quorum
meanwhile. This process (a "zygote") pays for it once: it imports the worker's and the
lighthouse's code, loads the corpus of DIR/job.json, then forks one child per request, and
each child runs exactly what ``diloco.worker.entry.main`` (a worker or a spare's worker) or ``python -m diloco.launch.lighthouse_process``
(the lighthouse) runs.

Forking is only safe from a single-threaded process (a lock another thread held at the
fork stays locked forever in the child), so the server starts no thread and runs no
parallel torch op: the launcher starts it with OMP_NUM_THREADS=1, which keeps libgomp and
OpenBLAS from creating their thread pools, and the server checks it is alone before it
serves. Each child sets its own thread count after the fork. The server installs no
signal handler, so a child starts with a fresh interpreter's.

The protocol is JSON lines. Requests on stdin: a worker
``{"id", "role": "worker", "group", "rank", "env": {RANK, ...}, "threads", "log", "started_at"}``
("role" may be left out), a worker of a warm spare the same with ``"spare": K`` in place of
"group" (it waits for the group it replaces: diloco.worker.spares), the lighthouse
``{"id", "role": "lighthouse", "log", "signature"}``.
Answers on stdout: ``{"id", "pid"}`` per request, then ``{"exited": pid, "code": c}`` when a
child exits, ``c`` as ``Popen.returncode`` (minus the signal number for a signal death). When
the launcher closes stdin or its lifeline, the server kills its children and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from diloco import lifeline
from diloco.launch.lighthouse_process import run_lighthouse
from diloco.launch.spawn import become_subreaper
from diloco.process_logging import output_to
from diloco.run_paths import RunPaths
from diloco.train.data import DataError, load_corpus
from diloco.worker.entry import load_job, run_launched_worker
from diloco.worker.env import WorkerEnv

REAP_INTERVAL_S = 0.05  # how soon a child's exit is reported when no request wakes the server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    lifeline.add_argument(parser)
    args = parser.parse_args(argv)
    if args.lifeline_fd is None:
        parser.error("--lifeline-fd is required: the launcher passes the read end of its lifeline")
    paths = RunPaths(args.run_dir)
    # Orphans of the workers (wandb's service outlives the leader that started it) come here
    # to be reaped, instead of piling up as zombies under the launcher, the next subreaper.
    become_subreaper()
    warm_up(paths)
    check_single_threaded()
    children: set[int] = set()
    serve(paths, args.lifeline_fd, children)
    for pid in children:  # the launcher is done or gone: a stopped child could not even notice it
        os.kill(pid, signal.SIGKILL)
    sys.stderr.flush()
    os._exit(0)  # nothing is left to write, and tearing down torch's modules takes a second


def warm_up(paths: RunPaths) -> None:
    """Load now what every worker would otherwise load after its fork (none of it starts a thread)."""
    job = load_job(paths, group=0)
    try:
        load_corpus(job.data)
    except DataError as error:  # each worker will load it and report it in its own log
        print(f"corpus not pre-loaded: {error}", file=sys.stderr, flush=True)
    import torch._dynamo  # noqa: F401  (torch.optim imports it for the first optimizer: 0.8 s of CPU)

    import diloco.worker.sharding  # noqa: F401  (FSDP, which diloco.worker.entry leaves to the worker: 1 s of CPU)

    if job.logger.mode != "disabled":
        import wandb  # noqa: F401  (the leader's wandb.init needs it: 0.85 s of CPU)


def check_single_threaded() -> None:
    """Refuse to serve from a process that runs other threads: its children could deadlock."""
    tasks = os.listdir("/proc/self/task")
    if len(tasks) > 1:
        names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks)
        raise RuntimeError(
            f"the fork server runs {len(tasks)} threads ({', '.join(names)}) after its imports, so forking "
            "workers from it is unsafe; start it with OMP_NUM_THREADS=1 (the launcher does), or use "
            "cluster.spawn=exec"
        )


def serve(paths: RunPaths, lifeline_fd: int, children: set[int]) -> None:
    """Fork a child per request and report every child's exit, until stdin or the lifeline closes."""
    pending = b""
    while True:
        readable, _, _ = select.select([sys.stdin.fileno(), lifeline_fd], [], [], REAP_INTERVAL_S)
        if lifeline_fd in readable and not os.read(lifeline_fd, 1):
            return
        if sys.stdin.fileno() in readable:
            chunk = os.read(sys.stdin.fileno(), 1 << 16)
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in filter(None, lines):
                request = json.loads(line)
                pid, go = fork_child(request, paths, lifeline_fd)
                children.add(pid)
                send({"id": request["id"], "pid": pid})
                with contextlib.suppress(BrokenPipeError):  # killed already: its exit report follows
                    os.write(go, b"!")  # the launcher knows it now: it may start
                os.close(go)
        reap(children)


def reap(children: set[int]) -> None:
    """Report each child that exited, then reap it; reap adopted orphans without a report.

    Peeking first (WNOWAIT) and reaping after the report means an exit status is never
    lost: if this server is killed in between, the child stays a zombie until the launcher,
    its subreaper, adopts and reaps it.
    """
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return  # no child at all
        if info is None:
            return
        if info.si_pid in children:
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            send({"exited": info.si_pid, "code": code})
            children.discard(info.si_pid)
        os.waitpid(info.si_pid, 0)


def send(message: dict[str, Any]) -> None:
    # One write of a short line to a pipe is atomic; nothing is buffered for a child to inherit.
    os.write(sys.stdout.fileno(), (json.dumps(message) + "\n").encode())


def fork_child(request: dict[str, Any], paths: RunPaths, lifeline_fd: int) -> tuple[int, int]:
    """Fork the worker or lighthouse ``request`` describes; returns its pid and the pipe end that
    lets it start once its pid is sent. The child never returns.

    A server killed or stopped between the fork and its answer leaves a child the launcher never
    heard of, and the launcher asks a fresh server again: two lighthouses on one port (the second
    cannot listen and the job fails) or two workers of one rank. So the child waits for the
    server's word that its pid went out; a server gone first (EOF) means it may be unknown, and
    it kills itself: an unknown one is gone, a known one reads as killed and is restarted.
    """
    wait_end, go_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wait_end)
        return pid, go_end
    os.close(go_end)
    if not os.read(wait_end, 1):
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(wait_end)
    code = 1
    try:
        become_launched(request, lifeline_fd)
        if request.get("role", "worker") == "lighthouse":
            run_lighthouse(paths.root, request["signature"])
            code = (
                0  # it returns once the job has ended: exit 0, as ``python -m diloco.launch.lighthouse_process`` does
            )
        else:
            os.environ.update(request["env"])
            torch.set_num_threads(request["threads"])  # OMP_NUM_THREADS is read once, when libgomp loads
            env = WorkerEnv.from_environ(os.environ)
            run_launched_worker(paths, request.get("group"), env, request["started_at"], spare=request.get("spare"))
    except SystemExit as request_to_exit:  # leave with its code, as a fresh interpreter would
        code = exit_code(request_to_exit)
    except BaseException:  # noqa: BLE001  (the child must leave here, never in the server's loop)
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_code(request: SystemExit) -> int:
    """The status ``sys.exit(x)`` gives a process: 0 for None, x for an int, else 1 after printing x."""
    if request.code is None or isinstance(request.code, int):
        return request.code or 0
    print(request.code, file=sys.stderr)
    return 1


def become_launched(request: dict[str, Any], lifeline_fd: int) -> None:
    """Turn the fresh child into what the launcher would have exec'd: own session, own log, the lifeline."""
    os.setsid()  # like start_new_session: only the launcher decides when a worker or the lighthouse stops
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # dup2 onto 0 and 1 also drops the server's request and answer pipes
    os.close(devnull)
    output_to(Path(request["log"]))
    lifeline.watch(lifeline_fd)


if __name__ == "__main__":
    main()
