"""The run directory's layout: every file a job writes, named once for its writers and readers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

JOB_FILE = "job.json"


@dataclass(frozen=True)
class RunPaths:
    """Files a run writes, all under one directory."""

    root: Path

    @property
    def job(self) -> Path:
        return self.root / JOB_FILE

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def weights(self) -> Path:
        return self.root / "model.pt"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def status_page(self) -> Path:
        """The lighthouse's status page as it stood when the lighthouse stopped: opens from disk."""
        return self.root / "status.html"

    @property
    def launcher_lock(self) -> Path:
        """Locked by the launcher running a job here (it holds its pid): one launcher per directory."""
        return self.root / "launcher.lock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def metrics(self, group: int) -> Path:
        return self.root / "metrics" / f"group{group}.jsonl"

    def all_metrics(self) -> list[Path]:
        """Every group's metrics file written so far."""
        return sorted((self.root / "metrics").glob("group*.jsonl"))

    def all_commits(self) -> list[Path]:
        """Every group's commit log written so far (a lighthouse finds them where the groups write)."""
        return sorted((self.root / "commits").glob("group*.jsonl"))

    def result(self, group: int) -> Path:
        return self.root / "results" / f"group{group}.json"

    def interrupted_weights(self, group: int) -> Path:
        """The global model a group held when a planned stop ended it (the launcher keeps the newest as model.pt)."""
        return self.root / "results" / f"group{group}.model.pt"

    def refusal(self, group: int) -> Path:
        """Why ``group`` was refused for a cause a restart would meet again: an orchestrator does not restart it."""
        return self.root / "refused" / f"group{group}.txt"

    def commits(self, group: int) -> Path:
        return self.root / "commits" / f"group{group}.jsonl"

    def fault_requests(self, group: int) -> Path:
        return self.root / "faults" / f"group{group}.requests"

    def worker_log(self, group: int, rank: int) -> Path:
        return self.logs / f"group{group}_rank{rank}.log"

    def spare_log(self, spare: int, rank: int) -> Path:
        return self.logs / f"spare{spare}_rank{rank}.log"

    def spare_pipe(self, spare: int, rank: int) -> Path:
        """Where the launcher tells rank ``rank`` of warm spare ``spare`` which group it replaces."""
        return self.root / "spares" / f"spare{spare}_rank{rank}.fifo"

    def outputs_present(self) -> list[str]:
        """What an earlier run left here (the launcher refuses to run a second job on top of it)."""
        names = [JOB_FILE, "summary.json", "model.pt", "events.jsonl", "results", "commits", "metrics", "logs"]
        names.append("checkpoints")
        return [name for name in names if (self.root / name).exists()]
