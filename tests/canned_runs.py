"""Canned run directories: the files a finished job leaves (summary.json, commit logs), written
by hand so the experiments' counting and table code is tested in milliseconds, not minutes."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def commit_record(round_: int, time: float, pid: int, digest: str | None, committed: bool = True, **extra) -> dict:
    """One line of a group's commit log, as the synchronizer writes it."""
    record = {"round": round_, "committed": committed, "healed": False, "closing": False, "digest": digest}
    return record | {"time": time, "pid": pid, "recoveries": 0} | extra


def canned_run(root: Path, name: str, faults: dict[str, int], goodput: float) -> Path:
    """A run directory of an ok 3-group, 100-step job with ``faults`` counted in its summary."""
    run_dir = root / name
    summary = {
        "ok": True,
        "failure": None,
        "groups": 3,
        "steps": 100,
        "wall_seconds": 60.0,
        "faults": faults,
        "lighthouse_restarts": 0,
        "syncs_committed": 9,
        "syncs_attempted": 10,
        "final_eval_loss": 2.0,
        "goodput_tokens_per_s": goodput,
        "time_to_heal_s": {"count": 0},
    }
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir
