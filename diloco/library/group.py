"""A replica group's own process group under torchrun, safe across the agent's restarts.

torchrun's agent serves one store to every restart of a group: a plain ``init_process_group``
in a restarted worker reads the dead incarnation's addresses from it and fails to connect (Gloo's
``connectFullMesh ... Connection refused``) or hangs. Each restart's keys go under a prefix of
their own instead. The job's workers (``diloco/worker/sharding.py``) and a script of one's own
(``init_group``) both join this way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from diloco.config.base import ConfigError
from diloco.refusal import refuse_group
from diloco.run_paths import RunPaths

RESTART_KEY = "TORCHELASTIC_RESTART_COUNT"
GROUP_ENV = "DILOCO_GROUP"  # this process's replica group, 0..M-1
RUN_DIR_ENV = "DILOCO_RUN_DIR"  # where the leader writes its commits and its result (optional)


def group_store(
    master_addr: str,
    master_port: int,
    world_size: int,
    rank: int,
    *,
    agent_hosts_store: bool,
    restart_count: int,
    connect_timeout_s: float,
) -> dist.Store:
    """The store the group's workers rendezvous on: torchrun's agent's, under this restart's prefix,
    or (started some other way) one that rank 0 hosts. ``connect_timeout_s`` bounds the wait for peers."""
    store: dist.Store = dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timedelta(seconds=connect_timeout_s),
    )
    return dist.PrefixStore(f"restart{restart_count}", store) if agent_hosts_store else store


def init_group(
    backend: str = "gloo",
    *,
    connect_timeout_s: float = 60.0,
    collective_timeout_s: float = 30.0,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """Join the group's default process group from torchrun's variables, as a restarted worker can.

    ``backend``: ``"gloo"`` on CPU, ``"nccl"`` (or ``"cpu:gloo,cuda:nccl"``) on GPUs. Every wait is
    bounded: peers to appear by ``connect_timeout_s``, one collective by ``collective_timeout_s``.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} in the environment: start the group's workers with torchrun")
    rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    store = group_store(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        world_size,
        rank,
        agent_hosts_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        restart_count=int(environ.get(RESTART_KEY) or 0),
        connect_timeout_s=connect_timeout_s,
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
    )


def refuse(message: str, environ: Mapping[str, str] = os.environ) -> NoReturn:
    """End this worker for a cause its next start would meet again (a missing corpus, a bad flag):
    ``message`` on stderr, exit 5, and under torchrun no restart of the group (its agent is
    stopped); with ``DILOCO_RUN_DIR`` and ``DILOCO_GROUP`` set the line is kept in
    ``RUN_DIR/refused/group<k>.txt`` for the orchestrator (docs/fault-tolerance.md, "Exit codes")."""
    run_dir, group = environ.get(RUN_DIR_ENV), environ.get(GROUP_ENV, "").strip()
    paths = RunPaths(Path(run_dir)) if run_dir else None
    refuse_group(f"error: {message}", paths, int(group) if group.isdigit() else None, environ)
