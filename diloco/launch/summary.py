"""summary.json: the job's numbers, read back from what the groups and the supervisor wrote.

Fault-tolerance figures come from the commit records (one per round, with its time) and the
event log: time to heal after each restart, survivors' stall per failure, and goodput.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any

from diloco.config.base import ConfigError
from diloco.config.job import JobConfig
from diloco.files import file_sha256, write_json_atomically
from diloco.launch.header import group_step_tokens
from diloco.launch.outcome import job_outcome
from diloco.run_paths import RunPaths
from diloco.train.checkpoint import whole_group_checkpoints
from diloco.train.logger import perplexity, read_jsonl

RESULT_POLL_S = 0.2
# Event kinds that take a group out: what stalls and recoveries follow ("hung": killed, stopped too long).
FAILURES = ("kill", "hang", "crash", "hung")
DEATHS = ("kill", "crash", "hung")  # the failures after which a replacement takes the group's place


def times_to_heal(events: list[dict], commits: dict[int, list[dict]]) -> list[float]:
    """Seconds from each restart to the restarted group's first committed round (or its heal at the job's end)."""
    healed = []
    for event in (e for e in events if e["kind"] == "restart"):
        back = [c for c in commits.get(event["group"], []) if c["committed"] or c.get("healed")]
        after = [c["time"] for c in back if c["time"] > event["time"]]
        if after:
            healed.append(min(after) - event["time"])
    return healed


def times_from_death_to_commit(events: list[dict], commits: dict[int, list[dict]]) -> list[float]:
    """Seconds from each death of a group (SIGKILL, crash) to the first round its replacement committed.

    Counts everything a replacement costs: noticing the death, any backoff, starting or
    taking over workers, joining, healing from a peer and that first round.
    """
    times = []
    for event in (e for e in events if e["kind"] in DEATHS):
        if (first := _first_commit_after(event, commits)) is not None:
            times.append(first["time"] - event["time"])
    return times


def _first_commit_after(event: dict, commits: dict[int, list[dict]]) -> dict | None:
    """The first round the event's group committed after it (its join round, which commits nothing, left out)."""
    back = [c for c in commits.get(event["group"], []) if c["committed"] and not c.get("join")]
    return min((c for c in back if c["time"] > event["time"]), key=lambda c: c["time"], default=None)


def times_from_death_to_ready(events: list[dict], commits: dict[int, list[dict]]) -> list[float]:
    """Seconds from each death of a group to its replacement's first ask for a quorum (its first record's)."""
    times = []
    for event in (e for e in events if e["kind"] in DEATHS):
        first = next((c for c in commits.get(event["group"], []) if c["time"] > event["time"]), None)
        if first is not None and "asked_at" in first:
            times.append(first["asked_at"] - event["time"])
    return times


def survivor_stalls(events: list[dict], commits: dict[int, list[dict]], rounds_after: int = 2) -> list[float]:
    """Per failure: the survivors' mean extra time blocked in sync over their next rounds.

    Extra means beyond the group's median round time (quorum, all-reduce, outer step);
    work lost because a round failed is not stall (it shows in committed syncs instead).
    """
    stalls = (_stall_after(e, commits, rounds_after) for e in events if e["kind"] in FAILURES)
    return [stall for stall in stalls if stall is not None]


def _stall_after(event: dict, commits: dict[int, list[dict]], rounds_after: int = 2) -> float | None:
    extra = []
    for group, records in commits.items():
        if group == event["group"] or len(records) < 2:
            continue
        usual = statistics.median(r["sync_ms"] for r in records)
        after = [r for r in records if r["time"] > event["time"]][:rounds_after]
        if after:
            extra.append(sum(max(0.0, r["sync_ms"] - usual) for r in after) / 1000)
    return sum(extra) / len(extra) if extra else None


def recovery_choices(events: list[dict], commits: dict[int, list[dict]]) -> list[dict[str, Any]]:
    """Each recovery choice the launcher made (diloco.launch.recovery), its predicted cost and the actual one.

    Actual, in group-seconds as predicted: the replacement's time from the death to its first
    committed round (that round's own sync time left out), plus every survivor's stall.
    """
    out = []
    for event in (e for e in events if e["kind"] == "plan"):
        first = _first_commit_after(event, commits)
        stall = _stall_after(event, commits)
        actual = None
        if first is not None:
            gone = first["time"] - event["time"] - first["sync_ms"] / 1000
            actual = gone + event["survivors"] * (stall or 0.0)
        out.append({"choice": event["choice"], "predicted": event["predicted"][event["choice"]], "actual": actual})
    return out


def earlier_processes_tokens(commits: dict[int, list[dict]], results: list[dict[str, Any]]) -> float:
    """Tokens a group's processes before the one that wrote its result trained up to their last
    committed round (a restart's, a killed spare's): its result counts its own steps only. What a
    process trained after its last commit is in no record, and is not counted."""
    last = {r["group"]: r.get("pid") for r in results}
    return sum(
        r.get("tokens", 0.0)
        for group, records in commits.items()
        for r in records
        if r["committed"] and r.get("pid") != last.get(group)
    )


def event_counts(events: list[dict], commits: dict[int, list[dict]]) -> dict[str, int]:
    """The launcher's events by kind; a job without a launcher (many hosts: torchrun restarts its groups)
    has the restarts its commit logs show, one per process of a group after its first."""
    if events:
        return {kind: sum(e["kind"] == kind for e in events) for kind in sorted({e["kind"] for e in events})}
    restarts = sum(max(0, len({r.get("pid") for r in records}) - 1) for records in commits.values())
    return {"restart": restarts} if restarts else {}


def heals_per_group(commits: dict[int, list[dict]], results: list[dict[str, Any]]) -> dict[int, int]:
    """Heals from a peer of each group over the whole job: every process of it (restarts included),
    each counting its own from 0; the last one's result counts a heal no later record carries."""
    per_process: dict[tuple[int, int], int] = {}
    for group, records in commits.items():
        for r in records:
            key = (group, r.get("pid", 0))
            per_process[key] = max(per_process.get(key, 0), r["recoveries"])
    heals = {group: sum(n for (g, _), n in per_process.items() if g == group) for group in commits}
    for r in results:
        heals[r["group"]] = max(heals.get(r["group"], 0), r.get("recoveries", 0))
    return heals


def state_losses(commits: dict[int, list[dict]]) -> list[dict[str, int]]:
    """Each time every group holding the job's newest state died before anyone healed from it:
    the newest round and inner step committed before, and the inner step the job went on from
    (the best surviving state), so the steps trained again are visible, not only in a log line."""
    records = [r for group_records in commits.values() for r in group_records]
    losses: dict[int, dict[str, int]] = {}  # by round floor: every quorum until the job passes it carries it
    for r in sorted(records, key=lambda r: r["time"]):
        if r.get("round_floor") and r["round_floor"] not in losses:
            before = [c for c in records if c["committed"] and c["time"] < r["time"]]
            losses[r["round_floor"]] = {
                "lost_round": max((c["round"] for c in before), default=0),
                "lost_step": max((c["inner_step"] for c in before), default=0),
                "went_on_from_step": r["inner_step"],
            }
    return list(losses.values())


def lost_work(
    job: JobConfig, results: list[dict[str, Any]], commits: dict[int, list[dict]], final_round: int | None
) -> dict[str, Any]:
    """What never reached the global model the job wrote, which exit 0 does not rule out: groups that could
    not meet train apart, and their steps end in no commit. ``algo=local`` has no global model to reach."""
    syncs = job.algo.name != "local"
    global_step = global_model_step(commits, final_round)
    step_tokens = group_step_tokens(job)
    per_group = {
        str(r["group"]): group_steps_lost(r, commits[r["group"]], step_tokens, job.algo.fragments) if syncs else 0
        for r in results
    }
    return {
        "global_step": global_step,
        "max_steps": job.trainer.max_steps,
        "steps_short": job.trainer.max_steps - global_step if syncs else 0,
        "per_group": per_group,
        "group_steps_lost": sum(per_group.values()),
    }


def global_model_step(commits: dict[int, list[dict]], final_round: int | None) -> int:
    """The inner step of the final round's commits (else of the newest round committed): the model's step."""
    syncs = [r for records in commits.values() for r in records if _carries(r)]
    last = final_round if final_round is not None else max((r["round"] for r in syncs), default=None)
    return max((r["inner_step"] for r in syncs if r["round"] == last), default=0)


def group_steps_lost(result: dict[str, Any], records: list[dict], step_tokens: int, fragments: int) -> int:
    """The inner steps a group trained in this run that none of its commits carries.

    Counted for the process that wrote the result, whose records end the group's log (a killed
    one's steps after its last round are in no record); the tokens before a resumed checkpoint
    are no work of this run. A commit carries its fragment's window up to its inner step, its
    tokens being 1/P of the window's (``algo.fragments``).
    """
    own = [r for r in records if r.get("pid") == records[-1].get("pid")] if records else []
    spans = [
        (r["inner_step"] - r.get("tokens", 0.0) * fragments / step_tokens, r["inner_step"]) for r in own if _carries(r)
    ]
    trained = (result["tokens_seen"] - result.get("resumed_tokens", 0)) / step_tokens
    return steps_no_commit_carries(trained, spans)


def steps_no_commit_carries(trained_steps: float, windows: list[tuple[float, float]]) -> int:
    """``trained_steps`` less the steps the committed windows (first, last] cover together: Streaming
    DiLoCo's fragments carry overlapping windows, so a step any commit carries is not lost (the
    earlier fragments' last steps, which the job's last rounds leave to the later ones, included)."""
    carried, reach = 0.0, -math.inf
    for first, last in sorted(windows):
        carried += max(0.0, last - max(first, reach))
        reach = max(reach, last)
    return max(0, round(trained_steps - carried))


def _carries(record: dict) -> bool:
    """A committed round of training: closing and join rounds move the job's state to a group, nothing more."""
    return record["committed"] and not (record.get("closing") or record.get("join"))


def round_phases(rounds: list[dict]) -> dict[str, dict[str, float]]:
    """Per phase of a committed round (``diloco.outer.phases``), its milliseconds over every group's rounds."""
    phases: dict[str, list[float]] = {}
    for r in rounds:
        if r["committed"]:
            for phase, ms in r.get("phases_ms", {}).items():
                phases.setdefault(phase, []).append(ms)
    return {phase: _stats(values) for phase, values in phases.items()}


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "median": statistics.median(values),
        "p90": statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0],
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def _choices(choices: list[dict[str, Any]]) -> dict[str, Any]:
    """How often the launcher waited or went on, and the cost it predicted beside what it measured."""
    measured = [c for c in choices if c["actual"] is not None]
    return {
        "wait": sum(c["choice"] == "wait" for c in choices),
        "go_on": sum(c["choice"] == "go_on" for c in choices),
        "predicted_cost_s": _stats([c["predicted"] for c in measured]),
        "actual_cost_s": _stats([c["actual"] for c in measured]),
    }


def read_results(job: JobConfig, paths: RunPaths) -> list[dict[str, Any]]:
    """The result records the groups' leaders wrote (none for a group that wrote none)."""
    return [json.loads(p.read_text()) for g in range(job.cluster.groups) if (p := paths.result(g)).exists()]


def build_summary(job: JobConfig, paths: RunPaths, n_params: int, wall_seconds: float) -> dict[str, Any]:
    """Job-level numbers and the honest outcome (docs/design.md, invariant 6): ``ok`` only if model.pt is
    the final global model every group holds; otherwise ``failure`` says why, in one line."""
    results = read_results(job, paths)
    events = read_jsonl(paths.events)
    commits = {g: read_jsonl(paths.commits(g)) for g in range(job.cluster.groups)}
    outcome = job_outcome(results, job.cluster.groups, job.algo.name, model_saved=paths.weights.exists())
    # The final model's numbers: those of the groups that saved it, else of the furthest groups.
    latest = max((r.get("rounds", 0) for r in results), default=0)
    current = [r for r in results if r["group"] in outcome.saved_by]
    current = current or [r for r in results if r.get("rounds", 0) == latest]
    tokens = sum(r["tokens_seen"] for r in results) + int(earlier_processes_tokens(commits, results))
    # Trained in this run: a resumed group's tokens_seen counts those before its checkpoint too.
    trained_here = tokens - sum(r.get("resumed_tokens", 0) for r in results)
    train_seconds = max((r["train_seconds"] for r in results), default=0.0)
    eval_loss = statistics.fmean(r["final_eval_loss"] for r in current) if current else math.nan
    # Counted from the commit logs, which every process of a group appends to (restarts included);
    # closing and join rounds move the job's state to a group, they are no syncs.
    rounds = [r for records in commits.values() for r in records if not (r.get("closing") or r.get("join"))]
    committed_tokens = sum(r.get("tokens", 0.0) for r in rounds if r["committed"])
    bytes_sent = sum(r.get("bytes_sent", 0) for r in results)
    heals = heals_per_group(commits, results)
    return {
        "name": job.name,
        "ok": outcome.ok,
        "failure": outcome.failure,
        "final_round": outcome.final_round,
        "model_saved_by_groups": list(outcome.saved_by),
        "model_sha256": model_sha256(paths),
        "groups_lost_after_end": list(outcome.lost_after_end),
        "parameters": n_params,
        "groups": job.cluster.groups,
        "workers_per_group": job.cluster.workers_per_group,
        "algo": job.algo.name,
        "steps": min((r["steps"] for r in results), default=0),
        "final_train_loss": statistics.fmean(r["final_train_loss"] for r in current) if current else math.nan,
        "final_eval_loss": eval_loss,
        "final_eval_ppl": perplexity(eval_loss),
        "tokens_seen": tokens,
        "tokens_planned": group_step_tokens(job) * job.cluster.groups * job.trainer.max_steps,
        "wall_seconds": wall_seconds,
        "train_seconds": train_seconds,
        "tokens_per_s": trained_here / train_seconds if train_seconds > 0 else 0.0,
        "rounds": latest,
        "syncs_committed": sum(r["committed"] for r in rounds),
        "syncs_attempted": len(rounds),
        "bytes_sent": bytes_sent,
        "bytes_per_token": bytes_sent / tokens if tokens else 0.0,
        "recoveries": sum(heals.values()),
        "state_lost": state_losses(commits),
        "lost_work": lost_work(job, results, commits, outcome.final_round),
        "goodput_tokens_per_s": committed_tokens / wall_seconds if wall_seconds > 0 else 0.0,
        "round_sync_ms": _stats([r["sync_ms"] for r in rounds if r["committed"]]),
        "round_phases_ms": round_phases(rounds),
        "faults": event_counts(events, commits),
        "lighthouse_restarts": sum(e["kind"] == "lighthouse_restart" for e in events),
        "time_to_heal_s": _stats(times_to_heal(events, commits)),
        "death_to_first_commit_s": _stats(times_from_death_to_commit(events, commits)),
        "death_to_ready_s": _stats(times_from_death_to_ready(events, commits)),
        "survivor_stall_s": _stats(survivor_stalls(events, commits)),
        "recovery_choices": _choices(recovery_choices(events, commits)),
        "groups_missing_results": sorted(set(range(job.cluster.groups)) - {r["group"] for r in results}),
        "per_group": [r | {"recoveries": heals.get(r["group"], 0)} for r in results],
    }


def interrupted_summary(paths: RunPaths, summary: dict[str, Any]) -> dict[str, Any]:
    """What a planned stop changes in the summary: not ok, ``interrupted``, and model.pt set to the
    newest committed global model a group kept when it stopped (the other groups' copies removed)."""
    kept = [r for r in summary["per_group"] if r.get("interrupted") and paths.interrupted_weights(r["group"]).exists()]
    newest = max(kept, key=lambda r: (r.get("rounds", 0), -r["group"]), default=None)
    if newest is not None:
        os.replace(paths.interrupted_weights(newest["group"]), paths.weights)
    for r in kept:
        paths.interrupted_weights(r["group"]).unlink(missing_ok=True)
    resumable = bool(whole_group_checkpoints(paths.root))
    resume = f"resume with trainer.resume={paths.root}" if resumable else "no checkpoint (trainer.checkpoint.every=0)"
    if newest is None:
        kept_model = "no group kept a model"
    else:
        kept_model = f"model.pt holds round {newest.get('rounds', 0)}'s global model (group {newest['group']})"
    return {
        "ok": False,
        "interrupted": True,
        "failure": f"interrupted (planned stop): {kept_model}; {resume}",
        "model_saved_by_groups": [] if newest is None else [newest["group"]],
        "model_sha256": model_sha256(paths),
        "final_round": None if newest is None else newest.get("rounds", 0),
    }


def model_sha256(paths: RunPaths) -> str | None:
    """The sha256 of the run's model.pt as the job left it: ``role=eval`` and ``role=sample``
    refuse a model.pt that no longer matches (a flipped bit still loads, as a slightly other model)."""
    return file_sha256(paths.weights) if paths.weights.exists() else None


def summarize_after_the_end(job: JobConfig, paths: RunPaths, wait_s: float) -> dict[str, Any]:
    """A multi-host job's lighthouse in the groups' run directory, once the job has ended: wait
    (at most ``wait_s``) for every group's result, then write summary.json as ``role=summary`` does."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(paths.result(g).exists() for g in range(job.cluster.groups)):
        time.sleep(RESULT_POLL_S)
    return summarize_finished_run(job, paths)


def summarize_finished_run(job: JobConfig, paths: RunPaths) -> dict[str, Any]:
    """``role=summary``: summary.json of a multi-host job from what its groups wrote into the shared
    run directory (results, commit logs), with the same honest outcome as a local job's.

    There is no launcher to time the job: its wall time is the longest group's training time.
    """
    results = read_results(job, paths)
    if not results:
        raise ConfigError(
            f"hydra.run.dir={paths.root}: no group wrote a result here; point it at the run directory "
            "every group of the multi-host job wrote into (their hydra.run.dir), after the job ended"
        )
    n_params = results[0]["parameters"]
    summary = build_summary(job, paths, n_params, wall_seconds=max(r["train_seconds"] for r in results))
    write_json_atomically(paths.summary, summary)
    return summary
