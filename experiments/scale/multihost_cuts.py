"""Groups that cannot reach each other, measured: how fast the job forms again around a cut, who
sits out and for how long, how soon the cut-off groups are back, and what it all costs.

A cut between two hosts that both still reach the lighthouse kills nothing: the groups on either
side fail the round they share, their probes tell the lighthouse which peers they cannot reach,
and it forms quorums only of groups that all reach each other (the largest such set; ties: the
freshest state, the last quorum's groups, then the lower group names), turning the others away until probes find their
link back (docs/fault-tolerance.md, "Groups that cannot reach each other"). Each scenario is a job
on namespaced hosts (``netns_hosts``: the lighthouse on ``lh``, group g under torchrun on
``g{g}``, one worker each, every link at ``--mbps``): the tiny model, 1500 inner steps of DiLoCo
with H=20 and no warm-up, ``cluster.timeouts.collective`` and ``.connect`` at 10 s.

- ``pair3``: 3 groups, g0 | g1 cut for 20 s once the job committed round 10;
- ``pair4``: 4 groups, the same cut;
- ``halves``: 4 groups, {g0, g1} | {g2, g3}: two sets as large;
- ``cut_from_half``: 4 groups, g3 cut from g0 and g1 while it still reaches g2;
- ``pair_at_start``: 3 groups, g0 | g1 cut before the groups start, healed 20 s after;
- ``slow_link``: 3 groups, g2's link at a tenth of ``--mbps`` for the whole job.

What it measures, from each run directory (summary.json and the commit records): the time from the
first failed round to the first commit of a quorum with no cut pair in it (the set kept, named);
each group that sat out (went without committing while others committed rounds without it) and
for how long; the time from the link's return to the first healed or committed record of each
group of the cut the last commit before it left out; the final model's inner step against
``trainer.max_steps`` and the group steps that never reached it (summary.json's ``lost_work``,
else the final round's commits); goodput against a fault-free run of the same group count, run in
the same invocation; the median round time (``sync_ms``) of the groups no fault touched against
the same groups' in that fault-free run (what a slow group costs the others); digest mismatches
(must be 0); and each part's exit code.

    python -m experiments.scale.multihost_cuts                      # every scenario and two fault-free runs: ~19 min
    python -m experiments.scale.multihost_cuts --only pair3 --quick # one scenario, 800 steps, a 15 s cut: ~2 min

Prints a markdown table, one row per scenario; writes it to ``--out`` (default
experiments/results/multihost_cuts): multihost_cuts.md, results.json (every figure) and the runs'
directories (runs-*/SCENARIO). Exits 1 if a run is not ok or any digest mismatches; 0 with a
one-line reason where network namespaces cannot be made here (netns_link.unavailable()).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from diloco.config.cluster import group_name
from experiments.common import RESULTS, markdown_table, stop_on_sigterm, write_result
from experiments.communication.netns_link import unavailable
from experiments.scale.multihost_chaos import commits, digest_mismatches, furthest_step
from experiments.scale.netns_hosts import LIGHTHOUSE, MultihostJob, NetnsHosts

H = 20
TIMEOUT_S = 10.0  # cluster.timeouts.collective and .connect: how long the round at a cut takes to fail
SLOW_SHARE = 10  # slow_link: the slow group's link at 1/SLOW_SHARE of --mbps
POLL_S = 0.25
FAULT_FREE = "fault-free"
Records = dict[int, list[dict[str, Any]]]


@dataclass(frozen=True)
class Scenario:
    name: str
    groups: int
    cuts: tuple[tuple[int, int], ...] = ()  # pairs of groups that cannot reach each other while it stands
    at_start: bool = False  # cut before the groups start (else once the job committed ``cut_after_round``)
    slow: int | None = None  # a group whose link runs at 1/SLOW_SHARE of --mbps all job long

    def untouched(self) -> list[int]:
        """The groups no cut and no slow link touches."""
        return [g for g in range(self.groups) if g != self.slow and not any(g in pair for pair in self.cuts)]


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("pair3", 3, cuts=((0, 1),)),
        Scenario("pair4", 4, cuts=((0, 1),)),
        Scenario("halves", 4, cuts=((0, 2), (0, 3), (1, 2), (1, 3))),
        Scenario("cut_from_half", 4, cuts=((3, 0), (3, 1))),
        Scenario("pair_at_start", 3, cuts=((0, 1),), at_start=True),
        Scenario("slow_link", 3, slow=2),
    )
}


@dataclass(frozen=True)
class Settings:
    steps: int
    cut_s: float  # how long a cut stands
    cut_after_round: int  # a cut mid-job: once any group committed this round
    timeout_s: float  # one job, launch to every part's exit


# A cut must outlast cluster.timeouts.collective: a shorter one fails no round, its TCP connections
# resuming once the link is back.
FULL = Settings(steps=1500, cut_s=20.0, cut_after_round=10, timeout_s=600.0)
QUICK = replace(FULL, steps=800, cut_s=15.0, cut_after_round=5, timeout_s=300.0)


def fault_free(groups: int) -> Scenario:
    return Scenario(f"{FAULT_FREE}-{groups}", groups)


def failed_at(records: Records, since: float) -> float | None:
    """When the first round after ``since`` failed, in any group (a join round commits nothing by design)."""
    times = [r["time"] for rs in records.values() for r in rs if r["time"] > since and _failed(r)]
    return min(times, default=None)


def _failed(record: dict[str, Any]) -> bool:
    return not record["committed"] and not record.get("join")


def reachable(participants: list[str], cuts: tuple[tuple[int, int], ...]) -> bool:
    """Whether a quorum holds no pair of groups cut from each other."""
    return not any({group_name(a), group_name(b)} <= set(participants) for a, b in cuts)


def reformed(records: Records, cuts: tuple[tuple[int, int], ...], since: float) -> dict[str, Any] | None:
    """The first commit after ``since`` by a quorum with no cut pair in it: the set the lighthouse kept."""
    kept = [r for rs in records.values() for r in rs if r["committed"] and r["time"] > since]
    return min((r for r in kept if reachable(r["participants"], cuts)), key=lambda r: r["time"], default=None)


def cut_off(records: Records, cuts: tuple[tuple[int, int], ...], at: float) -> list[int]:
    """The groups of ``cuts`` the last commit before ``at`` left out (all of them if none committed)."""
    before = [r for rs in records.values() for r in rs if r["committed"] and r["time"] < at]
    last = max(before, key=lambda r: r["time"], default=None)
    in_cuts = sorted({g for pair in cuts for g in pair})
    return [g for g in in_cuts if last is None or group_name(g) not in last["participants"]]


def seconds_to_back(records: list[dict[str, Any]], since: float) -> float | None:
    """From ``since`` to a group's first commit or heal after it; None if it has none."""
    times = [r["time"] for r in records if (r["committed"] or r.get("healed")) and r["time"] > since]
    return min(times) - since if times else None


def sat_out(records: Records, group: int) -> float:
    """How long ``group`` went without committing while others committed rounds without it: the
    gaps between its commits and heals (the job's first and last records bound them) in which a
    round it was no part of was committed, added up; 0 if it took part in every round committed."""
    every = [r for rs in records.values() for r in rs]
    if not every:
        return 0.0
    own = sorted(r["time"] for r in records[group] if r["committed"] or r.get("healed"))
    bounds = [min(r["time"] for r in every), *own, max(r["time"] for r in every)]
    without = [r["time"] for r in every if r["committed"] and group_name(group) not in r["participants"]]
    return sum(b - a for a, b in pairwise(bounds) if any(a < t < b for t in without))


def model_step(summary: dict[str, Any], records: Records, max_steps: int) -> dict[str, int | None]:
    """The final model's inner step against ``trainer.max_steps``, and the group steps that never
    reached it: summary.json's ``lost_work``, else the final round's largest committed inner step."""
    if "lost_work" in summary:
        lost = summary["lost_work"]
        return {"step": lost["global_step"], "max_steps": lost["max_steps"], "lost": lost["group_steps_lost"]}
    final = [
        r["inner_step"]
        for rs in records.values()
        for r in rs
        if r["committed"] and r["round"] == summary.get("final_round")
    ]
    return {"step": max(final, default=None), "max_steps": max_steps, "lost": None}


def median_sync_ms(records: Records, groups: list[int]) -> float | None:
    """The median round time of ``groups``' committed rounds."""
    times = [r["sync_ms"] for g in groups for r in records[g] if r["committed"]]
    return statistics.median(times) if times else None


def job_overrides(cfg: Settings) -> list[str]:
    return [
        f"trainer.max_steps={cfg.steps}",
        f"algo.sync_every={H}",
        "trainer.warmup_share=0",
        f"cluster.timeouts.collective={TIMEOUT_S:g}",
        f"cluster.timeouts.connect={TIMEOUT_S:g}",
    ]


def cut(hosts: NetnsHosts, cuts: tuple[tuple[int, int], ...], undo: bool = False) -> float:
    """Cut (or heal) every pair of ``cuts``; when it was done."""
    for a, b in cuts:
        (hosts.heal if undo else hosts.partition)(f"g{a}", f"g{b}")
    return time.time()


def _wait_until(done: Callable[[], bool], job: MultihostJob, deadline: float, what: str) -> None:
    """Poll ``done``; fail naming ``what`` if the job ended first (too few steps) or ``deadline`` passed."""
    while not done():
        if job.summary() is not None or time.time() > deadline:
            raise RuntimeError(f"no {what} before the job ended or timed out: raise trainer.max_steps")
        time.sleep(POLL_S)


def run_job(scenario: Scenario, cfg: Settings, mbps: float, work: Path) -> dict[str, Any]:
    """One job of ``scenario`` on hosts of its own, its cut made and healed; what it left, read back."""
    names = [LIGHTHOUSE, *(f"g{g}" for g in range(scenario.groups))]
    rates = dict.fromkeys(names, mbps)
    if scenario.slow is not None:
        rates[f"g{scenario.slow}"] = mbps / SLOW_SHARE
    started = time.time()
    deadline = started + cfg.timeout_s
    cut_at = back_at = None
    with (
        NetnsHosts(names, rates) as hosts,
        MultihostJob(hosts, work, groups=scenario.groups, overrides=job_overrides(cfg), name="cuts") as job,
    ):
        if scenario.cuts and scenario.at_start:
            cut_at = cut(hosts, scenario.cuts)
        job.start()
        launched = time.time()
        if scenario.cuts and not scenario.at_start:
            furthest = cfg.cut_after_round * H
            _wait_until(lambda: furthest_step(commits(job.run_dir, job.groups)) >= furthest, job, deadline, "round")
            cut_at = cut(hosts, scenario.cuts)
        if scenario.cuts:
            time.sleep(max(0.0, (launched if scenario.at_start else cut_at) + cfg.cut_s - time.time()))
            back_at = cut(hosts, scenario.cuts, undo=True)
        ended = job.wait(timeout_s=max(30.0, deadline - time.time()))
        summary = job.summary()
    print(f"{scenario.name} done in {time.time() - started:.0f}s", file=sys.stderr, flush=True)
    return {
        "scenario": scenario,
        "work_dir": str(work),
        "launched": launched,
        "cut_at": cut_at,
        "back_at": back_at,
        "summary": summary or {},
        "records": commits(job.run_dir, scenario.groups),
        "exit_codes": {part: e.returncode for part, e in ended.items()},
        "killed_at_timeout": [part for part, e in ended.items() if e.killed],
    }


def figures(run: dict[str, Any], base: dict[str, Any] | None, cfg: Settings, mbps: float) -> dict[str, Any]:
    """Every number of a run's row (also written to results.json); ``base``: the fault-free run beside it."""
    scenario, records, s = run["scenario"], run["records"], run["summary"]
    since = run["launched"] if run["cut_at"] is None else run["cut_at"]
    back = run["back_at"]
    failed = failed_at(records, since)
    kept = reformed(records, scenario.cuts, failed) if failed is not None else None
    sat = {g: t for g in range(scenario.groups) if (t := sat_out(records, g)) > 0}
    untouched = scenario.untouched()
    out = {
        "fault": describe(scenario, cfg, mbps),
        "ok": bool(s.get("ok")),
        "failure": s.get("failure") if s else "no summary.json",
        "failed_s": failed - since if failed is not None else None,  # since the cut, or the launch
        "reformed_s": kept["time"] - failed if kept else None,
        "reformed_as": kept["participants"] if kept else None,
        "sat_out_s": sat,
        "back_s": {g: seconds_to_back(records[g], back) for g in cut_off(records, scenario.cuts, back)} if back else {},
        "model": model_step(s, records, cfg.steps),
        "goodput_tokens_per_s": s.get("goodput_tokens_per_s"),
        "untouched": untouched,
        "untouched_sync_ms": median_sync_ms(records, untouched),
        "digest_mismatches": digest_mismatches(s) if s else None,
        "exit_codes": run["exit_codes"],
        "killed_at_timeout": run["killed_at_timeout"],
    }
    if base is not None:
        out["goodput_ratio"] = _ratio(out["goodput_tokens_per_s"], base["summary"].get("goodput_tokens_per_s"))
        out["fault_free_sync_ms"] = median_sync_ms(base["records"], untouched)
        out["sync_ratio"] = _ratio(out["untouched_sync_ms"], out["fault_free_sync_ms"])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _num(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def describe(scenario: Scenario, cfg: Settings, mbps: float) -> str:
    """The scenario's fault, in a table cell."""
    if scenario.slow is not None:
        return f"g{scenario.slow} at {mbps / SLOW_SHARE:g} Mbit/s all job"
    if not scenario.cuts:
        return "none"
    pairs = ", ".join(f"g{a} | g{b}" for a, b in scenario.cuts)
    when = "from before the start" if scenario.at_start else f"after round {cfg.cut_after_round}"
    return f"{pairs} for {cfg.cut_s:g} s {when}"


def _per_group(values: dict[int, float | None]) -> str:
    return ", ".join(f"g{g} {_num(v)}" for g, v in values.items()) or "none"


def _reformed(n: dict[str, Any]) -> str:
    if n["failed_s"] is None:
        return "no round failed"
    if n["reformed_as"] is None:
        return "no reachable set committed"
    return f"{n['reformed_s']:.1f} ({', '.join(p.removeprefix('group') for p in n['reformed_as'])})"


def _model(m: dict[str, int | None]) -> str:
    return f"{_num(m['step'], 'd')} / {m['max_steps']}" + ("" if m["lost"] is None else f" ({m['lost']})")


def _sync(n: dict[str, Any]) -> str:
    if not n["untouched"]:
        return "no untouched group"
    groups = "+".join(f"g{g}" for g in n["untouched"])
    ms, fault_free_ms = _num(n["untouched_sync_ms"], ".0f"), _num(n.get("fault_free_sync_ms"), ".0f")
    return f"{groups}: {ms} vs {fault_free_ms} ({_num(n.get('sync_ratio'), '.2f')})"


def _exit_codes(n: dict[str, Any]) -> str:
    return ", ".join(f"{part} {code}" for part, code in n["exit_codes"].items())


COLUMNS = [
    ("fault", lambda n: n["fault"]),
    ("first failed round to a reachable set's commit s (groups)", _reformed),
    ("sat out s", lambda n: _per_group(n["sat_out_s"])),
    ("link back to healed/committed s", lambda n: _per_group(n["back_s"])),
    ("model step / max_steps (group steps lost)", lambda n: _model(n["model"])),
    ("goodput / fault-free", lambda n: _num(n.get("goodput_ratio"), ".3f")),
    ("untouched groups' sync ms vs fault-free (ratio)", _sync),
    ("digest mismatches", lambda n: _num(n["digest_mismatches"], "d")),
    ("exit codes", _exit_codes),
    ("ok", lambda n: f"{n['ok']}" + (f" ({n['failure']})" if n["failure"] else "")),
]


def table(numbers: dict[str, dict[str, Any]]) -> str:
    """One row per scenario (a ``|`` in a cell escaped, as markdown needs)."""
    rows = [[name, *(cell(n).replace("|", "\\|") for _, cell in COLUMNS)] for name, n in numbers.items()]
    return markdown_table(["scenario", *(label for label, _ in COLUMNS)], rows)


def baseline_line(groups: int, n: dict[str, Any]) -> str:
    """A fault-free run's figures, the ones its scenarios are held against."""
    return (
        f"- fault-free, {groups} groups: goodput {_num(n['goodput_tokens_per_s'], ',.0f')} tokens/s, model step "
        f"{_model(n['model'])}, median sync {_num(n['untouched_sync_ms'], '.0f')} ms, digest mismatches "
        f"{n['digest_mismatches']}, exit codes {_exit_codes(n)}, ok {n['ok']}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), metavar="NAME", help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK.steps} steps, {QUICK.cut_s:g} s cuts: a smoke test"
    )
    parser.add_argument("--mbps", type=float, default=200.0, help="every host's link rate; slow_link: a tenth of it")
    parser.add_argument(
        "--out", metavar="DIR", help="results and run directories (default experiments/results/multihost_cuts)"
    )
    args = parser.parse_args()
    if args.mbps <= 0:
        parser.error(f"--mbps={args.mbps}: must be > 0")
    return args


def main() -> None:
    args = parse_args()
    if (why := unavailable()) is not None:
        print(f"multihost_cuts skipped: {why}")
        return
    stop_on_sigterm()
    cfg = QUICK if args.quick else FULL
    chosen = [SCENARIOS[name] for name in args.only or SCENARIOS]
    out = Path(args.out) if args.out else RESULTS / "multihost_cuts"
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(tempfile.mkdtemp(prefix=time.strftime("runs-%Y%m%d-%H%M%S-"), dir=out))
    print(f"runs in {runs_dir}", file=sys.stderr)
    began = time.monotonic()
    counts = sorted({s.groups for s in chosen})
    bases = {n: run_job(fault_free(n), cfg, args.mbps, runs_dir / fault_free(n).name) for n in counts}
    runs = {s.name: run_job(s, cfg, args.mbps, runs_dir / s.name) for s in chosen}
    numbers = {name: figures(r, bases[r["scenario"].groups], cfg, args.mbps) for name, r in runs.items()}
    base_numbers = {n: figures(b, None, cfg, args.mbps) for n, b in bases.items()}
    setup = (
        f"DiLoCo H={H}, {cfg.steps} inner steps, no warm-up, groups x 1 worker on hosts g0.. and the lighthouse "
        f"on lh, each a network namespace with a {args.mbps:g} Mbit/s link; cluster.timeouts.collective and "
        f".connect {TIMEOUT_S:g} s; a cut is silent (packets dropped), the groups cut still reach the lighthouse."
    )
    lines = [setup, "", table(numbers), "", *(baseline_line(n, base_numbers[n]) for n in counts)]
    text = "\n".join(lines)
    print(text)
    write_result("multihost_cuts.md", text, str(out))
    results = {
        "settings": asdict(cfg) | {"mbps": args.mbps, "h": H, "timeout_s": TIMEOUT_S},
        "runs_dir": str(runs_dir),
        "scenarios": {s.name: asdict(s) for s in chosen},
        "figures": numbers,
        "fault_free": base_numbers,
        "times": {  # time.time() of each run's launch, cut and link's return, to read its records again
            r["scenario"].name: {k: r[k] for k in ("launched", "cut_at", "back_at")}
            for r in [*bases.values(), *runs.values()]
        },
    }
    path = write_result("results.json", json.dumps(results, indent=2, default=str), str(out))
    print(f"results written to {path}; total {time.monotonic() - began:.0f}s", file=sys.stderr)
    every = [*numbers.values(), *base_numbers.values()]
    sys.exit(1 if any(not n["ok"] or n["digest_mismatches"] != 0 for n in every) else 0)


if __name__ == "__main__":
    main()
