"""Where a worker runs: its place in the group (torchrun's environment) and its device.

The launcher imports this too, so FSDP, whose imports take a second, lives in diloco.worker.sharding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from diloco.config.base import ConfigError
from diloco.train.flops import Peak, handed_peak

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
RESTART_KEY = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class WorkerEnv:
    """Where one worker sits in its replica group: torchrun's variables (and the peak the local
    launcher measured for it), read once at an entry point."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_hosts_store: bool = False  # torchrun's agent already serves the store at MASTER_PORT
    # torchrun's restart of this group (TORCHELASTIC_RESTART_COUNT; 0 at its first start). The agent
    # keeps one store for every restart, so each restart's keys need a prefix of their own.
    restart_count: int = 0
    under_agent: bool = False  # started by torch's elastic agent (torchrun), which restarts the group
    peak: Peak | None = None  # its CPU's peak, from the local launcher (diloco.train.flops); None: it measures its own

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> WorkerEnv:
        """torchrun's variables from ``environ``; ``ConfigError`` (one line: what is missing or
        malformed, and how to start a group) if they are not all there as torchrun sets them."""
        missing = [k for k in TORCHRUN_KEYS if not environ.get(k)]
        if missing:
            raise ConfigError(
                f"missing {', '.join(missing)} in the environment: role=group runs one worker of a "
                "replica group and expects torchrun's variables (torchrun --nproc-per-node N run.py role=group ...)"
            )
        numbers = {key: _integer(environ, key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        if not 0 <= numbers["RANK"] < numbers["WORLD_SIZE"]:
            raise ConfigError(
                f"RANK={numbers['RANK']} with WORLD_SIZE={numbers['WORLD_SIZE']}: the rank must be in "
                "[0, WORLD_SIZE); start the group with torchrun, which sets both"
            )
        return cls(
            rank=numbers["RANK"],
            world_size=numbers["WORLD_SIZE"],
            local_rank=numbers["LOCAL_RANK"],
            master_addr=environ["MASTER_ADDR"],
            master_port=numbers["MASTER_PORT"],
            agent_hosts_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            restart_count=_integer(environ, RESTART_KEY) if environ.get(RESTART_KEY) else 0,
            under_agent=bool(environ.get("TORCHELASTIC_RUN_ID")),
            peak=handed_peak(environ),
        )

    def to_environ(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            **(self.peak.to_environ() if self.peak else {}),
        }


def _integer(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise ConfigError(
            f"{key}={environ[key]!r} in the environment: must be an integer; start the group with torchrun, which sets it"
        ) from None
