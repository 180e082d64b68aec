"""What restarting a killed group costs: a fresh python per worker against a fork of the warm fork server.

One job per way of starting workers (``cluster.spawn=exec``, then ``cluster.spawn=fork``),
each with 3 groups of one CPU process training the tiny model with DiLoCo at H=10
(``conf/experiment/bench_restart.yaml``). Once every group committed a round together, the
last group is killed ``--kills`` times with SIGKILL (``LocalCluster.signal_group``); each
time, as soon as the survivors committed a round without it, it is restarted
(``LocalCluster.start_group``) and two numbers are taken when its first committed round
appears in its commit log (the record carries the new leader's pid):

- seconds from ``start_group`` to that commit: start-up, rendezvous, quorum, healing from a
  live peer in its join round (which commits nothing), then the wait for the peers' next
  round and that round itself;
- CPU seconds the new worker spent until then (``/proc/<pid>/stat``: user + system).

The fork server's own start-up (imports and corpus, paid once per job, not per restart) is
shown beside the table.

    python -m experiments.fault_tolerance.bench_restart            # 5 kills per mode: about 3 minutes on two cores
    python -m experiments.fault_tolerance.bench_restart --quick    # 2 kills per mode

Prints a markdown table (median and max per mode) and the ratios exec / fork, and writes it
to experiments/results/bench_restart.md. Timings on a shared 2-core machine are noisy: read
the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.common import (
    ClusterRun,
    add_output_arguments,
    compose_job,
    markdown_table,
    median,
    runs_root,
    write_result,
)

HEADERS = [
    "spawn",
    "restarts",
    "median s to first commit",
    "max s",
    "median worker CPU s",
    "max worker CPU s",
    "first commits after a heal",
]
ENDLESS = 100_000  # max_steps: the job is stopped once measured
MODES = ("exec", "fork")


@dataclass
class Restart:
    seconds: float
    cpu_s: float
    healed: bool  # the restarted group's first commit came after a recovery from a peer


@dataclass
class Mode:
    spawn: str
    restarts: list[Restart]
    server_cpu_s: float | None  # the fork server's start-up, once per job

    def cells(self) -> list[str]:
        seconds = [r.seconds for r in self.restarts]
        cpu = [r.cpu_s for r in self.restarts]
        return [
            self.spawn,
            str(len(self.restarts)),
            f"{median(seconds):.2f}",
            f"{max(seconds):.2f}",
            f"{median(cpu):.2f}",
            f"{max(cpu):.2f}",
            f"{sum(r.healed for r in self.restarts)}/{len(self.restarts)}",
        ]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (fields 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_commit_of(run: ClusterRun, group: int, pid: int) -> dict | None:
    return next((r for r in run.commits(group) if r["committed"] and r["pid"] == pid), None)


def time_restart(run: ClusterRun, groups: int, timeout_s: float) -> Restart:
    """Kill the last group, let the others commit without it, restart it; time its way to a commit."""
    victim = groups - 1
    survivor_lines = len(run.commits(0))
    run.cluster.signal_group(victim, signal.SIGKILL)
    run.cluster.wait_for(
        lambda: run.committed_by(0, groups - 1, survivor_lines),
        timeout_s,
        f"the survivors to commit without group {victim}",
        poll_s=0.2,
    )
    started = time.monotonic()
    run.cluster.start_group(victim)
    pid = run.cluster.groups[victim][0].process.pid
    run.cluster.wait_for(
        lambda: first_commit_of(run, victim, pid) is not None,
        timeout_s,
        f"restarted group {victim} to commit",
        poll_s=0.05,
    )
    seconds = time.monotonic() - started
    cpu_s = cpu_seconds(pid)
    return Restart(seconds, cpu_s, first_commit_of(run, victim, pid)["recoveries"] >= 1)


def measure(spawn: str, kills: int, run_dir: Path, timeout_s: float) -> Mode:
    job = compose_job([f"cluster.spawn={spawn}", f"trainer.max_steps={ENDLESS}"], "bench_restart")
    groups = job.cluster.groups
    with ClusterRun(job, run_dir) as run:
        run.cluster.wait_for(
            lambda: all(run.committed_by(g, groups) for g in range(groups)),
            timeout_s,
            f"all {groups} groups to commit a round together",
            poll_s=0.5,
        )
        restarts = [time_restart(run, groups, timeout_s) for _ in range(kills)]
        server = run.cluster.fork_server
        server_cpu_s = cpu_seconds(server.process.pid) if server is not None else None
    return Mode(spawn, restarts, server_cpu_s)


def report(modes: dict[str, Mode], job_groups: int) -> str:
    exec_, fork = modes["exec"], modes["fork"]

    def ratio(key: str) -> float:
        return median([getattr(r, key) for r in exec_.restarts]) / median([getattr(r, key) for r in fork.restarts])

    lines = [
        f"Restarting a SIGKILLed group ({job_groups} groups x 1 CPU worker, tiny model, H=10): "
        "from start_group to the group's first committed round, and the new worker's CPU until then",
        "",
        markdown_table(HEADERS, [m.cells() for m in modes.values()]),
        "",
        f"exec / fork: {ratio('seconds'):.1f}x the seconds to first commit, {ratio('cpu_s'):.1f}x the worker CPU "
        f"(medians); the fork server's start-up, once per job: {fork.server_cpu_s:.1f} CPU s",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 kills per mode: a smoke test")
    parser.add_argument("--kills", type=int, help="restarts timed per mode (default 5; --quick: 2)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds any one wait may take")
    add_output_arguments(parser)
    args = parser.parse_args()
    kills = args.kills or (2 if args.quick else 5)

    modes = {}
    with runs_root(args.keep_runs, "bench_restart") as root:
        for spawn in MODES:
            started = time.monotonic()
            modes[spawn] = measure(spawn, kills, root / spawn, args.timeout)
            print(f"spawn={spawn} measured in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    text = report(modes, compose_job([], "bench_restart").cluster.groups)
    print(text)
    print(f"table written to {write_result('bench_restart.md', text, args.results)}", file=sys.stderr)


if __name__ == "__main__":
    main()
