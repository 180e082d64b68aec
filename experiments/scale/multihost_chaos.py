"""A multi-host job under chaos: faults between hosts, then the same job fault-free, side by side.

Each host is a network namespace (``netns_hosts.NetnsHosts``): the lighthouse on host ``lh`` under
multihost.sbatch's restart loop, group g under ``torchrun --max-restarts`` on host ``g{g}`` (4 groups
of ``--workers-per-group`` workers, 1 by default), every link at ``--mbps``. The tiny model trains
``--steps`` inner steps (4400: long enough to deal every kind) with DiLoCo, H=20 (``algo.sync_every=20``,
no warm-up). Every 20-30 s (seeded by ``--seed``) one fault is drawn from nine kinds, each dealt once
before any repeats:

- ``kill_worker``: a worker SIGKILLed (torchrun restarts its group, which heals from a peer);
- ``kill_host``: every process on a group's host SIGKILLed, its torchrun started again 3 s later;
- ``stop_worker``: a worker SIGSTOPped for good (the group's guard kills it after
  ``cluster.timeouts.stopped=5``, then torchrun restarts the group);
- ``kill_lighthouse``: the lighthouse SIGKILLed (its loop starts it again);
- ``link_down``: a group's link down for 20 s, then up (the group is dropped, then heals);
- ``partition``: two groups cut from each other (each still reaching the rest) for 20 s, healed;
- ``halves``: the groups in two halves that cannot reach each other (all still reach the
  lighthouse) for 20 s, healed;
- ``cut_from_half``: one group cut from half of the others (it still reaches the rest) for 20 s;
- ``slow_link``: a group's link shaped to a tenth of ``--mbps`` for 30 s, then restored.

One fault at a time: the next one starts 20-30 s after the previous one did, and never before it
has ended (undone, and every group it hit committed or healed since, or 60 s passed), so one
fault's effects never overlap another's. No fault starts in the last 10% of the steps.

What it measures, per run, from the run directory (summary.json, the commit logs, the parts' logs):
faults by kind and whether the groups hit came back; recoveries (heals from a peer); committed /
attempted rounds; digest mismatches among the groups that finished (must be 0); the survivors'
stall per fault: for each group a fault did not hit (every group, for the lighthouse), the
longest time it went without committing a round across the fault, beyond its usual time between
commits (median over its rounds), the worst survivor per fault, median / max over faults; beside
it summary.json's own survivors' stall (``diloco.launch.summary.survivor_stalls``: extra time in
sync over the next two rounds); goodput (committed tokens per second: summary.json's, and over
the harness's wall time from launch to summary.json) and its ratio to the fault-free run; wall
seconds; final eval loss; and each part's exit code.

    python -m experiments.scale.multihost_chaos            # ~5 min faulted + ~4.5 min fault-free, on 2 idle cores
    python -m experiments.scale.multihost_chaos --quick    # 2 groups, a handful of shorter faults: ~2.5 min, a smoke test

Prints a markdown table and a line per fault; writes them to ``--out`` (default
experiments/results/multihost_chaos): multihost_chaos.md, results.json (every figure, every fault
with the log lines it caused) and the runs' directories (runs-*/faulted, runs-*/fault-free).
Exits 1 if the faulted run is not ok or any digest mismatches; 0 with a one-line reason where
network namespaces cannot be made here (netns_link.unavailable()). Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from diloco.launch.summary import survivor_stalls
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from experiments.common import RESULTS, markdown_table, stop_on_sigterm, write_result
from experiments.communication.netns_link import unavailable
from experiments.fault_tolerance.kill_every import digests_equal
from experiments.scale.netns_hosts import LIGHTHOUSE, MultihostJob, NetnsHosts

KINDS = (
    "kill_worker",
    "kill_host",
    "stop_worker",
    "kill_lighthouse",
    "link_down",
    "partition",
    "halves",
    "cut_from_half",
    "slow_link",
)
CUTS = ("partition", "halves", "cut_from_half")  # faults between group hosts that all still reach the lighthouse
DEATHS = ("kill_worker", "kill_host", "stop_worker")  # the group hit comes back as new processes
# Faults that keep groups out of rounds for as long as they last, whatever the recovery: how many.
# A cut keeps the smaller side out (one of a pair, one half, the group cut from half); a slow link sits out.
KEPT_OUT = {
    "link_down": len,
    "slow_link": len,
    "halves": len,
    "partition": lambda hit: 1,
    "cut_from_half": lambda hit: 1,
}
FAULTED, FAULT_FREE = "faulted", "fault-free"
H = 20
POLL_S = 0.25
MAX_LOG_LINES = 12  # per part and fault, in results.json
# Lines of a part's log worth keeping beside the fault that caused them.
NOTABLE = re.compile(
    r"healed|heal_from\": \{\"|dropp|restart|not committed|giving up|gave up|refused|Traceback|Error|error|exit|"
    r"killed|failed|lost|quorum again|died|stopped|warning|WARNING",
)


@dataclass(frozen=True)
class Settings:
    groups: int
    steps: int
    kinds: tuple[str, ...]
    gap_s: tuple[float, float]  # between the starts of two faults, drawn uniformly
    first_after_s: float  # the first fault: this long after the job's first committed round
    down_s: float  # link_down
    partition_s: float
    slow_s: float  # slow_link
    host_back_s: float  # kill_host: the host's torchrun started again after this
    back_within_s: float  # a fault has ended at the latest this long after it was undone
    stopped_s: float  # cluster.timeouts.stopped
    last_fault_at: float  # no fault starts past this fraction of the steps
    max_restarts: int  # torchrun's, per group
    timeout_s: float  # the whole job, launch to every part's exit


FULL = Settings(
    groups=4,
    steps=4400,
    kinds=KINDS,
    gap_s=(20.0, 30.0),
    first_after_s=10.0,
    down_s=20.0,
    partition_s=20.0,
    slow_s=30.0,
    host_back_s=3.0,
    back_within_s=60.0,
    stopped_s=5.0,
    last_fault_at=0.9,
    max_restarts=10,
    timeout_s=900.0,
)
# Two groups: a cut would leave no group unaffected, so the cuts are left out; every other fault
# hits one group (or the lighthouse), leaving the other.
QUICK = replace(
    FULL,
    groups=2,
    steps=1000,
    kinds=tuple(k for k in KINDS if k not in CUTS),
    gap_s=(8.0, 12.0),
    first_after_s=3.0,
    down_s=8.0,
    slow_s=10.0,
    host_back_s=2.0,
    back_within_s=40.0,
    timeout_s=300.0,
)


@dataclass
class Fault:
    """One fault: when it started (time.time()), was undone, and ended (the groups hit back, or not)."""

    kind: str
    hit: list[int]  # groups hit; [] for the lighthouse
    started: float
    undone: float | None = None
    ended: float | None = None
    back: bool | None = None  # every group hit committed or healed after it was undone; None: the job ended first
    detail: str = ""
    log: dict[str, list[str]] = field(default_factory=dict)  # notable lines each part logged meanwhile


class Deck:
    """The faults' kinds in a seeded random order, each dealt once before any is dealt again."""

    def __init__(self, kinds: tuple[str, ...], rng: random.Random) -> None:
        self.kinds, self.rng, self._left = kinds, rng, []

    def draw(self, groups: int) -> tuple[str, list[int]]:
        """The next kind and the groups it hits: two for a partition, half of them for ``halves``
        (one side), one and then half of the others for ``cut_from_half`` (the group cut off first),
        none for the lighthouse, else one."""
        if not self._left:
            self._left = list(self.kinds)
            self.rng.shuffle(self._left)
        kind = self._left.pop()
        if kind == "kill_lighthouse":
            return kind, []
        if kind == "cut_from_half":
            cut_off, *others = self.rng.sample(range(groups), 1 + groups // 2)
            return kind, [cut_off, *sorted(others)]
        return kind, sorted(self.rng.sample(range(groups), {"partition": 2, "halves": groups // 2}.get(kind, 1)))


def cut_pairs(kind: str, hit: list[int], groups: int) -> list[tuple[int, int]]:
    """The pairs of groups a cut fault separates: the two of a partition, every pair across the
    halves (``hit`` one side), or the first group hit from each of the others hit."""
    if kind == "halves":
        return [(a, b) for a in hit for b in range(groups) if b not in hit]
    return [(hit[0], b) for b in hit[1:]]


def commits(run_dir: Path, groups: int) -> dict[int, list[dict[str, Any]]]:
    """Every group's commit records so far (the records of all its processes in turn)."""
    paths = RunPaths(run_dir)
    return {g: read_jsonl(paths.commits(g)) for g in range(groups)}


def furthest_step(records: dict[int, list[dict[str, Any]]]) -> int:
    return max((r["inner_step"] for rs in records.values() for r in rs if r["committed"]), default=0)


def is_back(records: list[dict[str, Any]], since: float, old_pids: set[int]) -> bool:
    """Whether a group committed or healed after ``since``, in a process other than ``old_pids``."""
    return any(
        (r["committed"] or r.get("healed")) and r["time"] > since and r.get("pid") not in old_pids for r in records
    )


def usual_gap(records: list[dict[str, Any]]) -> float | None:
    """A group's median time between two committed rounds."""
    times = sorted(r["time"] for r in records if r["committed"])
    gaps = [b - a for a, b in pairwise(times)]
    return statistics.median(gaps) if gaps else None


def survivor_gap(records: list[dict[str, Any]], start: float, end: float) -> float | None:
    """The longest time a group went without committing a round during [start, end] (from its last
    commit before ``start``; a stall still going at ``end`` counted up to ``end``, and none after
    the group's last step: a finished group waits for the job's end), beyond its usual gap; None
    if it had committed nothing before ``start`` (not started yet, or gone)."""
    usual = usual_gap(records)
    committed = [r for r in records if r["committed"]]
    times = sorted(r["time"] for r in committed)
    before = [t for t in times if t <= start]
    if usual is None or not before:
        return None
    last_step = max(r["inner_step"] for r in committed)
    end = min(end, min(r["time"] for r in committed if r["inner_step"] == last_step))
    after = [t for t in times if t > end]
    across = [before[-1], *(t for t in times if start < t <= end), min(after[0], end) if after else end]
    return max(0.0, max((b - a for a, b in pairwise(across)), default=0.0) - usual)


def survivors(fault: Fault, groups: int) -> list[int]:
    return [g for g in range(groups) if g not in fault.hit]


def fault_stalls(fault: Fault, records: dict[int, list[dict[str, Any]]]) -> tuple[float | None, float | None]:
    """The worst survivor's stall across the fault (``survivor_gap``) and summary.json's survivors'
    stall (extra sync time over the next rounds, the mean over survivors) for it."""
    kept = survivors(fault, len(records))
    end = fault.ended or fault.undone or fault.started
    gaps = [g for s in kept if (g := survivor_gap(records[s], fault.started, end)) is not None]
    extra = survivor_stalls([{"kind": "kill", "group": -1, "time": fault.started}], {s: records[s] for s in kept})
    return (max(gaps) if gaps else None), (extra[0] if extra else None)


def goodput_ceiling(faults: list[Fault], groups: int, wall_s: float | None) -> float | None:
    """The goodput ratio the faults leave at best, 1 − Σ (groups kept out × the fault's length) /
    (groups × the job's wall): the work of a group kept out while a fault lasts reaches no commit
    however fast it comes back (it heals from the others' newer state). Deaths and the lighthouse
    keep nobody out by this measure: their whole cost is the recovery's."""
    if not wall_s:
        return None
    out = sum(KEPT_OUT[f.kind](f.hit) * ((f.undone or f.started) - f.started) for f in faults if f.kind in KEPT_OUT)
    return 1.0 - out / (groups * wall_s)


def median_max(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.1f} / {max(values):.1f} (n={len(values)})"


def digest_mismatches(summary: dict[str, Any]) -> int:
    """Groups that finished holding a digest other than the most common one (or none)."""
    digests = Counter(r.get("digest") for r in summary["per_group"])
    common = digests.most_common(1)[0][0] if digests else None
    return sum(n for d, n in digests.items() if d != common or d is None)


class Chaos:
    """Faults injected into a running ``job`` on ``hosts``, one at a time, as ``settings`` say."""

    def __init__(
        self, hosts: NetnsHosts, job: MultihostJob, settings: Settings, mbps: float, seed: int, job_start: float
    ) -> None:
        self.hosts, self.job, self.cfg, self.mbps = hosts, job, settings, mbps
        self.job_start = job_start  # time.time() at launch, for the offsets printed
        self.deck = Deck(settings.kinds, random.Random(seed))
        self.gap_rng = random.Random(seed + 1)
        self.faults: list[Fault] = []

    def ended(self) -> bool:
        return (self.job.run_dir / "summary.json").exists()

    def records(self) -> dict[int, list[dict[str, Any]]]:
        return commits(self.job.run_dir, self.cfg.groups)

    def run(self, deadline: float) -> None:
        """Inject faults until the job nears its last steps (or ends, or ``deadline`` passes)."""
        while not self.ended() and not any(r["committed"] for rs in self.records().values() for r in rs):
            if time.time() > deadline:
                return
            time.sleep(POLL_S)
        next_at = time.time() + self.cfg.first_after_s
        while True:
            if not self._sleep_until(next_at, deadline):
                return
            if furthest_step(self.records()) >= self.cfg.last_fault_at * self.cfg.steps:
                return
            fault = self.inject(*self.deck.draw(self.cfg.groups))
            self.faults.append(fault)
            print(self.describe(fault, self.job_start), file=sys.stderr, flush=True)
            next_at = max(fault.started + self.gap_rng.uniform(*self.cfg.gap_s), fault.ended or 0.0)

    def _sleep_until(self, when: float, deadline: float) -> bool:
        """Sleep until ``when``; False if the job ended or ``deadline`` passed first."""
        while time.time() < when:
            if self.ended() or time.time() > deadline:
                return False
            time.sleep(POLL_S)
        return not self.ended()

    def inject(self, kind: str, hit: list[int]) -> Fault:
        logs = {p.stem: p.stat().st_size for p in self.job.log_dir.glob("*.log")}
        old_pids = {pid for g in hit for pid in self.job.worker_pids(g)} | self._leader_pids(hit)
        fault = Fault(kind, hit, started=time.time())
        try:
            self._do(fault)
        except LookupError as error:  # no worker or lighthouse process to hit (between restarts)
            fault.detail += f"not injected: {error}"
            fault.undone = time.time()
        self._await_end(fault, old_pids if kind in DEATHS else set())
        fault.log = self._notable(logs)
        return fault

    def _leader_pids(self, hit: list[int]) -> set[int]:
        """Pids the groups hit committed under so far (their leaders')."""
        records = self.records()
        return {r["pid"] for g in hit for r in records[g] if "pid" in r}

    def _do(self, fault: Fault) -> None:
        hosts, job, cfg = self.hosts, self.job, self.cfg
        name = [f"g{g}" for g in fault.hit]
        if fault.kind == "kill_worker":
            fault.detail = f"pid {job.kill_worker(fault.hit[0])}"
        elif fault.kind == "stop_worker":
            fault.detail = f"pid {job.stop_worker(fault.hit[0])}"
        elif fault.kind == "kill_host":
            hosts.kill_host(name[0])
            time.sleep(cfg.host_back_s)
            job.start_group(fault.hit[0])
        elif fault.kind == "kill_lighthouse":
            killed = job.kill_lighthouse()
            fault.detail = f"pid {killed}"
            deadline = time.time() + cfg.back_within_s
            while not [p for p in job.lighthouse_pids() if p != killed] and time.time() < deadline:
                time.sleep(0.1)
        elif fault.kind == "link_down":
            hosts.link_down(name[0])
            time.sleep(cfg.down_s)
            hosts.link_up(name[0])
        elif fault.kind in CUTS:
            pairs = cut_pairs(fault.kind, fault.hit, cfg.groups)
            fault.detail = ", ".join(f"g{a}|g{b}" for a, b in pairs)
            for a, b in pairs:
                hosts.partition(f"g{a}", f"g{b}")
            time.sleep(cfg.partition_s)
            for a, b in pairs:
                hosts.heal(f"g{a}", f"g{b}")
        elif fault.kind == "slow_link":
            hosts.shape(name[0], self.mbps / 10)
            fault.detail = f"{self.mbps / 10:g} Mbit/s"
            time.sleep(cfg.slow_s)
            hosts.shape(name[0], self.mbps)
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")
        fault.undone = time.time()

    def _await_end(self, fault: Fault, old_pids: set[int]) -> None:
        """Until every group hit is back (or, for the lighthouse, any group committed since it
        was restarted), the job ended, or ``back_within_s`` passed."""
        deadline = fault.undone + self.cfg.back_within_s
        while True:
            records = self.records()
            if fault.hit:
                back = all(is_back(records[g], fault.undone, old_pids) for g in fault.hit)
            else:
                back = any(is_back(rs, fault.undone, set()) for rs in records.values())
            if back or self.ended() or time.time() > deadline:
                fault.back = True if back else (None if self.ended() else False)
                fault.ended = time.time()
                return
            time.sleep(POLL_S)

    def _notable(self, offsets: dict[str, int]) -> dict[str, list[str]]:
        found = {}
        for path in sorted(self.job.log_dir.glob("*.log")):
            with open(path, "rb") as log:
                log.seek(offsets.get(path.stem, 0))
                lines = log.read().decode(errors="replace").splitlines()
            kept = [line[:300] for line in lines if NOTABLE.search(line)]
            if kept:
                found[path.stem] = kept[:MAX_LOG_LINES] + (
                    [f"... {len(kept) - MAX_LOG_LINES} more"] * (len(kept) > MAX_LOG_LINES)
                )
        return found

    @staticmethod
    def describe(fault: Fault, start: float) -> str:
        hit = ", ".join(f"g{g}" for g in fault.hit) or LIGHTHOUSE
        undone = fault.undone - fault.started if fault.undone else float("nan")
        took = fault.ended - fault.started if fault.ended else float("nan")
        back = {True: "back", False: "NOT back", None: "job ended first"}[fault.back]
        detail = f" ({fault.detail})" if fault.detail else ""
        return (
            f"{fault.started - start:6.1f}s {fault.kind} {hit}{detail}: undone after {undone:.1f}s, "
            f"ended after {took:.1f}s: {back}"
        )


def job_overrides(cfg: Settings, seed: int) -> list[str]:
    return [
        f"trainer.max_steps={cfg.steps}",
        f"trainer.seed={seed}",
        f"algo.sync_every={H}",
        "algo.sync_warmup_steps=0",
        f"cluster.min_groups={min(2, cfg.groups - 1) or 1}",
        f"cluster.timeouts.stopped={cfg.stopped_s:g}",
    ]


def run_job(hosts: NetnsHosts, work: Path, cfg: Settings, args: argparse.Namespace, chaos: bool) -> dict[str, Any]:
    """One job on ``hosts`` in ``work`` (faults injected if ``chaos``); what it left, read back."""
    name = FAULTED if chaos else FAULT_FREE
    started = time.time()
    with MultihostJob(
        hosts,
        work,
        groups=cfg.groups,
        workers_per_group=args.workers_per_group,
        overrides=job_overrides(cfg, args.seed),
        max_restarts=cfg.max_restarts,
        name="chaos",
    ) as job:
        job.start()
        faults: list[Fault] = []
        if chaos:
            injector = Chaos(hosts, job, cfg, args.mbps, args.seed, started)
            try:
                injector.run(deadline=started + cfg.timeout_s)
            finally:
                faults = injector.faults
        ended = job.wait(timeout_s=max(30.0, started + cfg.timeout_s - time.time()))
        summary = job.summary()
        leftovers = job.leftovers()
    summary_path = job.run_dir / "summary.json"
    wall = summary_path.stat().st_mtime - started if summary_path.exists() else time.time() - started
    records = commits(job.run_dir, cfg.groups)
    heals = {
        f"g{g}": (job.log_dir / f"g{g}.log").read_text(errors="replace").count("healed") for g in range(cfg.groups)
    }
    print(f"{name} run done in {time.time() - started:.0f}s", file=sys.stderr, flush=True)
    return {
        "name": name,
        "work_dir": str(work),
        "start": started,
        "wall_s": wall,
        "summary": summary,
        "records": records,
        "faults": faults,
        "ended": ended,
        "healed_lines": heals,
        "leftovers": leftovers,
    }


def figures(run: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """Every number of the table for one run (also written to results.json)."""
    s, records, faults = run["summary"] or {}, run["records"], run["faults"]
    stalls = [fault_stalls(f, records) for f in faults]
    committed_tokens = s.get("goodput_tokens_per_s", 0.0) * s.get("wall_seconds", 0.0)
    out = {
        "ok": s.get("ok"),
        "failure": s.get("failure"),
        "faults": dict(Counter(f.kind for f in faults)),
        "faults_back": sum(f.back is True for f in faults),
        "faults_not_back": sum(f.back is False for f in faults),
        "recoveries": s.get("recoveries"),
        "healed_lines": run["healed_lines"],
        "syncs_committed": s.get("syncs_committed"),
        "syncs_attempted": s.get("syncs_attempted"),
        "final_round": s.get("final_round"),
        "digest_mismatches": digest_mismatches(s) if s else None,
        "digests": digests_equal(s)[1] if s else "no summary.json",
        "survivor_gap_s": [g for g, _ in stalls if g is not None],
        "survivor_extra_sync_s": [e for _, e in stalls if e is not None],
        "usual_gap_s": statistics.median(u for rs in records.values() if (u := usual_gap(rs)) is not None)
        if any(usual_gap(rs) is not None for rs in records.values())
        else None,
        "goodput_tokens_per_s": s.get("goodput_tokens_per_s"),
        "goodput_harness_tokens_per_s": committed_tokens / run["wall_s"] if run["wall_s"] > 0 else 0.0,
        "wall_s": run["wall_s"],
        "summary_wall_s": s.get("wall_seconds"),
        "final_eval_loss": s.get("final_eval_loss"),
        "exit_codes": {part: e.returncode for part, e in run["ended"].items()},
        "killed_at_timeout": [part for part, e in run["ended"].items() if e.killed],
        "leftovers": run["leftovers"],
    }
    if base is not None and base["summary"]:
        b = figures(base, None)
        out["goodput_ratio"] = _ratio(out["goodput_tokens_per_s"], b["goodput_tokens_per_s"])
        out["goodput_harness_ratio"] = _ratio(out["goodput_harness_tokens_per_s"], b["goodput_harness_tokens_per_s"])
        out["goodput_ceiling"] = goodput_ceiling(faults, len(records), s.get("wall_seconds"))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _num(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


ROWS = [
    ("summary ok", lambda n: f"{n['ok']}" + (f" ({n['failure']})" if n["failure"] else "")),
    ("faults injected", lambda n: ", ".join(f"{k} {v}" for k, v in sorted(n["faults"].items())) or "none"),
    ("faults whose groups came back / not", lambda n: f"{n['faults_back']} / {n['faults_not_back']}"),
    (
        "recoveries (summary.json; 'healed' in logs)",
        lambda n: f"{n['recoveries']} ({', '.join(f'{k} {v}' for k, v in n['healed_lines'].items())})",
    ),
    ("committed / attempted rounds", lambda n: f"{n['syncs_committed']} / {n['syncs_attempted']}"),
    ("final round", lambda n: str(n["final_round"])),
    ("digest mismatches among finished groups", lambda n: f"{n['digest_mismatches']} ({n['digests']})"),
    ("survivors' stall per fault s, no commit beyond usual (median / max)", lambda n: median_max(n["survivor_gap_s"])),
    (
        "survivors' extra sync per fault s, summary.json's (median / max)",
        lambda n: median_max(n["survivor_extra_sync_s"]),
    ),
    ("usual time between commits s (median)", lambda n: _num(n["usual_gap_s"], ".2f")),
    ("goodput, summary.json's (committed tokens/s)", lambda n: _num(n["goodput_tokens_per_s"], ",.0f")),
    ("goodput ratio faulted / fault-free (summary.json's)", lambda n: _num(n.get("goodput_ratio"), ".3f")),
    (
        "goodput ratio ceiling: 1 − groups kept out x the fault's length / groups x wall",
        lambda n: _num(n.get("goodput_ceiling"), ".3f"),
    ),
    ("goodput over the harness's wall (tokens/s)", lambda n: _num(n["goodput_harness_tokens_per_s"], ",.0f")),
    ("goodput ratio over the harness's wall", lambda n: _num(n.get("goodput_harness_ratio"), ".3f")),
    (
        "wall s: launch to summary.json (summary.json's)",
        lambda n: f"{n['wall_s']:.0f} ({_num(n['summary_wall_s'], '.0f')})",
    ),
    ("final eval loss", lambda n: _num(n["final_eval_loss"], ".4f")),
    ("exit codes", lambda n: ", ".join(f"{k} {v}" for k, v in n["exit_codes"].items())),
    (
        "killed at the timeout / processes left",
        lambda n: f"{n['killed_at_timeout'] or 'none'} / {n['leftovers'] or 'none'}",
    ),
]


def table(numbers: dict[str, dict[str, Any]]) -> str:
    return markdown_table(["", *numbers], [[label, *(cell(n) for n in numbers.values())] for label, cell in ROWS])


def fault_lines(run: dict[str, Any]) -> list[str]:
    """A line per fault: when, what, how long until undone and ended, the survivors' stall."""
    lines = []
    for fault in run["faults"]:
        gap, extra = fault_stalls(fault, run["records"])
        lines.append(
            f"- {Chaos.describe(fault, run['start'])}; survivors' stall {_num(gap)}s (extra sync {_num(extra, '.2f')}s)"
        )
    return lines


def fault_record(fault: Fault, run: dict[str, Any]) -> dict[str, Any]:
    """A fault as results.json holds it: seconds since launch, and each survivor's stall across it."""
    records, end = run["records"], fault.ended or fault.undone or fault.started
    gaps = {s: survivor_gap(records[s], fault.started, end) for s in survivors(fault, len(records))}
    return asdict(fault) | {"at_s": fault.started - run["start"], "survivor_gap_s": gaps}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 groups, shorter faults every 8-12 s: a smoke test")
    parser.add_argument(
        "--steps", type=int, help=f"inner steps, a multiple of {H} (default {FULL.steps}; --quick {QUICK.steps})"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the faults' draw and of the job (trainer.seed)")
    parser.add_argument("--workers-per-group", type=int, default=1, help="workers of each group's torchrun (default 1)")
    parser.add_argument("--mbps", type=float, default=100.0, help="every host's link rate; slow_link: a tenth of it")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, help="only these faults (default: all nine)")
    parser.add_argument("--partition-s", type=float, help=f"how long a partition lasts (default {FULL.partition_s:g})")
    parser.add_argument(
        "--out", metavar="DIR", help="results and run directories (default experiments/results/multihost_chaos)"
    )
    args = parser.parse_args()
    if args.partition_s is not None and args.partition_s <= 0:
        parser.error(f"--partition-s={args.partition_s}: must be > 0 seconds")
    if args.steps is not None and (args.steps < H or args.steps % H):
        parser.error(f"--steps={args.steps}: must be a positive multiple of H={H}")
    if args.mbps <= 0 or args.workers_per_group < 1:
        parser.error("--mbps must be > 0 and --workers-per-group >= 1")
    return args


def main() -> None:
    args = parse_args()
    if (why := unavailable()) is not None:
        print(f"multihost_chaos skipped: {why}")
        return
    stop_on_sigterm()
    cfg = QUICK if args.quick else FULL
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    if args.kinds:
        cfg = replace(cfg, kinds=tuple(args.kinds))
    if args.partition_s is not None:
        cfg = replace(cfg, partition_s=args.partition_s)
    out = Path(args.out) if args.out else RESULTS / "multihost_chaos"
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(tempfile.mkdtemp(prefix=time.strftime("runs-%Y%m%d-%H%M%S-"), dir=out))
    began = time.monotonic()
    names = [LIGHTHOUSE, *(f"g{g}" for g in range(cfg.groups))]
    with NetnsHosts(names, args.mbps) as hosts:
        print(f"hosts: {', '.join(f'{n} {hosts.address(n)}' for n in names)}; runs in {runs_dir}", file=sys.stderr)
        runs = {
            FAULTED: run_job(hosts, runs_dir / FAULTED, cfg, args, chaos=True),
            FAULT_FREE: run_job(hosts, runs_dir / FAULT_FREE, cfg, args, chaos=False),
        }
    numbers = {FAULTED: figures(runs[FAULTED], runs[FAULT_FREE]), FAULT_FREE: figures(runs[FAULT_FREE], None)}
    setup = (
        f"DiLoCo H={H}, {cfg.groups} groups x {args.workers_per_group} worker(s) on hosts g0..g{cfg.groups - 1} and the "
        f"lighthouse on lh, each a network namespace with a {args.mbps:g} Mbit/s link; {cfg.steps} inner steps; "
        f"faults every {cfg.gap_s[0]:g}-{cfg.gap_s[1]:g} s (seed {args.seed}), one at a time; "
        f"cluster.timeouts.stopped={cfg.stopped_s:g}, torchrun --max-restarts {cfg.max_restarts}."
    )
    text = "\n".join([setup, "", table(numbers), "", "Faults (seconds since launch):", *fault_lines(runs[FAULTED])])
    print(text)
    bad = [
        f"{part} exited {e.returncode}:\n{e.tail[-1500:]}"
        for r in runs.values()
        for part, e in r["ended"].items()
        if e.returncode
    ]
    for lines in bad:
        print(lines, file=sys.stderr)
    write_result("multihost_chaos.md", text, str(out))
    results = {
        "settings": asdict(cfg) | {"seed": args.seed, "mbps": args.mbps, "workers_per_group": args.workers_per_group},
        "runs_dir": str(runs_dir),
        "figures": numbers,
        "faults": [fault_record(f, runs[FAULTED]) for f in runs[FAULTED]["faults"]],
        "tails": {r["name"]: {p: e.tail for p, e in r["ended"].items() if e.returncode} for r in runs.values()},
    }
    path = write_result("results.json", json.dumps(results, indent=2, default=str), str(out))
    print(f"results written to {path}; total {time.monotonic() - began:.0f}s", file=sys.stderr)
    faulted = numbers[FAULTED]
    failed = not faulted["ok"] or any(n["digest_mismatches"] != 0 for n in numbers.values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
