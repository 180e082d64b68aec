"""``python -m diloco.launch.script_groups --groups M SCRIPT [ARGS...]``: one's own training script
(a loop wrapped in ``DiLoCo``, docs/library.md) run as M replica groups on this machine.

The one-machine trial of the multi-host layout: a lighthouse on loopback (in this process, with
a fresh job token), and each group under torchrun (``--standalone``, N workers, restarted up to
``--max-restarts`` times when one dies), given the job through the variables ``DiLoCo`` reads:
``DILOCO_LIGHTHOUSE``, ``DILOCO_GROUP``, ``DILOCO_JOB``, ``DILOCO_RUN_DIR`` and
``DILOCO_LIGHTHOUSE_TOKEN`` (in the environment only: never in a file or on a command line).
On many hosts the same script runs under the user's own torchrun per group, with the lighthouse
from ``python run.py role=lighthouse``.

Exits 0 only if every group exited 0 and the groups the lighthouse named holders of the final
model wrote one digest (``RUN_DIR/results``); otherwise 1, with the reason in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

from diloco.config.base import ConfigError
from diloco.config.cluster import ClusterConfig, LighthouseConfig, TimeoutsConfig, group_name
from diloco.config.redaction import TOKEN_ENV
from diloco.exits import exit_without_teardown
from diloco.ft.lighthouse import Lighthouse, save_page
from diloco.huge_pages import HUGE_PAGES_ENV
from diloco.launch.local_cluster import last_exception
from diloco.library.loop import GROUP_ENV, JOB_ENV, LIGHTHOUSE_ENV, RUN_DIR_ENV
from diloco.run_paths import RunPaths

POLL_S = 0.2


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m diloco.launch.script_groups",
        description="Run your own DiLoCo training script as replica groups on this machine.",
    )
    parser.add_argument("--groups", type=int, default=2, help="replica groups M (default 2)")
    parser.add_argument("--workers-per-group", type=int, default=1, help="torchrun's --nproc-per-node (default 1)")
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun's restarts of a group (default 3)")
    parser.add_argument("--run-dir", type=Path, default=None, help="commits, results, logs (default runs/script-TIME)")
    parser.add_argument("--job", default="diloco", help="the job's name, as the lighthouse knows it")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the groups are stopped")
    parser.add_argument("script", help="the training script each worker runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    for key in ("groups", "workers_per_group"):
        if getattr(args, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')}={getattr(args, key)}: must be >= 1")
    if args.max_restarts < 0 or args.timeout <= 0:
        raise ConfigError("--max-restarts must be >= 0 and --timeout > 0 seconds")
    if not Path(args.script).is_file():
        raise ConfigError(f"{args.script}: no such script")
    return args


def run(args: argparse.Namespace) -> str | None:
    """Serve the job's lighthouse while its groups train; the reason the job failed, or None."""
    paths = RunPaths(args.run_dir or Path("runs") / time.strftime("script-%Y%m%d-%H%M%S"))
    if paths.root.exists() and any(paths.root.iterdir()):
        raise ConfigError(f"--run-dir={paths.root} holds a run already: pick a new folder")
    paths.logs.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    rules = ClusterConfig(groups=args.groups, min_groups=1).quorum_rules()
    with Lighthouse(LighthouseConfig(token=token), rules, args.job) as lighthouse:
        print(f"lighthouse for job {args.job!r} at {lighthouse.url}; status page {lighthouse.url}/", flush=True)
        job_env = {
            LIGHTHOUSE_ENV: lighthouse.url,
            JOB_ENV: args.job,
            RUN_DIR_ENV: str(paths.root.resolve()),
            TOKEN_ENV: token,
        }
        environ = {HUGE_PAGES_ENV: "1"} | os.environ | job_env  # huge pages as run.py has them, unless set
        groups = {g: start_group(g, args, environ, paths) for g in range(args.groups)}
        (paths.root / "groups.json").write_text(json.dumps({g: p.pid for g, p in groups.items()}))
        print(
            f"{args.groups} groups of {args.workers_per_group} running {args.script}; logs in {paths.logs}", flush=True
        )
        codes = wait_for(groups, args.timeout, paths)
        save_page(lighthouse, paths.status_page)
    return verdict(codes, paths, args.groups)


def start_group(group: int, args: argparse.Namespace, environ: dict[str, str], paths: RunPaths) -> subprocess.Popen:
    """Group ``group`` under torchrun, in a session of its own (stopped as a whole)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={args.workers_per_group}",
        f"--max-restarts={args.max_restarts}",
        args.script,
        *args.script_args,
    ]
    log = (paths.logs / f"{group_name(group)}.log").open("w")
    return subprocess.Popen(
        command,
        env=environ | {GROUP_ENV: str(group)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for(groups: dict[int, subprocess.Popen], timeout_s: float, paths: RunPaths) -> dict[int, int | None]:
    """Each group's exit code (None: still running at ``timeout_s``, at Ctrl-C or once a group was
    refused (``diloco.refusal``: the job cannot end as asked), and stopped)."""
    stop = {"asked": False}
    previous = {s: signal.signal(s, lambda *_: stop.update(asked=True)) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not stop["asked"]:
            if all(p.poll() is not None for p in groups.values()) or any(paths.refusal(g).exists() for g in groups):
                break
            time.sleep(POLL_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    codes = {g: p.poll() for g, p in groups.items()}
    for p in groups.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in groups.values():
        try:
            p.wait(timeout=TimeoutsConfig().stop)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return codes


def verdict(codes: dict[int, int | None], paths: RunPaths, groups: int) -> str | None:
    """Why the job failed (one line), or None: every group exited 0 and the holders agree."""
    refused = [g for g in codes if paths.refusal(g).exists()]
    if refused:
        return (
            f"{group_name(refused[0])} was refused, and not restarted: {paths.refusal(refused[0]).read_text().strip()}"
        )
    running = [g for g, code in codes.items() if code is None]
    if running:
        return f"{group_name(running[0])} was still running when stopped (--timeout, or a signal)"
    failed = {g: code for g, code in codes.items() if code}
    if failed:
        g, code = next(iter(failed.items()))
        log = paths.logs / f"{group_name(g)}.log"
        cause = last_exception(log, ignoring="ChildFailedError") or "torchrun's restarts used up, or the script failed"
        return f"{group_name(g)} exited {code} ({cause}); its log: {log}"
    results = {g: json.loads(paths.result(g).read_text()) for g in range(groups) if paths.result(g).exists()}
    if len(results) < groups:
        missing = min(set(range(groups)) - set(results))
        return (
            f"{group_name(missing)} exited 0 without a result: its script must run its loop inside `with DiLoCo(...)`"
        )
    holders = {g: r["digest"] for g, r in results.items() if group_name(g) in (r.get("end") or {}).get("holders", ())}
    if not holders:
        return "no group holds the job's final model"
    if len(set(holders.values())) > 1:
        return f"the groups holding the final model disagree: {holders}"
    rounds = max(r["rounds"] for r in results.values())
    recoveries = sum(r.get("recoveries", 0) for r in results.values())
    digest = next(iter(holders.values()))
    print(
        f"done: {groups} groups, {rounds} rounds, {len(holders)} holding one final model (digest {digest[:12]}…), "
        f"{recoveries} recoveries; results in {paths.root / 'results'}",
        flush=True,
    )
    return None


def main(argv: list[str] | None = None) -> NoReturn:
    try:
        problem = run(parse(argv))
    except ConfigError as error:
        exit_without_teardown(2, f"error: {error}")
    exit_without_teardown(1 if problem else 0, problem and f"job failed: {problem}")


if __name__ == "__main__":
    main()
