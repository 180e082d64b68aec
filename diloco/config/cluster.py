"""Where a job runs: replica groups, workers per group, device, the lighthouse, and every timeout."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields
from typing import Literal

from diloco.config.base import check
from diloco.config.redaction import TOKEN_ENV


@dataclass(frozen=True)
class LighthouseConfig:
    """Where the lighthouse listens; ``token`` is the job's secret (empty: none required).

    The token is never given as a value (it would land in hydra's files): ``token_file`` names
    a file holding it, or the environment's ``DILOCO_LIGHTHOUSE_TOKEN`` carries it; ``run.py``
    reads it into ``token`` (``diloco.launch.job_token``). Here with the rest of ``cluster.*``
    rather than in the server module, so a group's processes, which read this config, never
    import the lighthouse server.
    """

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port; a multi-host job sets a fixed one
    token: str = ""
    token_file: str = ""  # a file whose content is the token (multi-host roles; a local job makes one)
    store_port: int = 0  # the TCPStore it hosts; 0 picks a free port
    history: int = 50  # quorums kept for /status

    def validate(self) -> None:
        check(bool(self.host), "cluster.lighthouse.host", self.host, "must be an address to bind, e.g. 127.0.0.1")
        for key in ("port", "store_port"):
            value = getattr(self, key)
            check(
                0 <= value <= 65535, f"cluster.lighthouse.{key}", value, "must be in [0, 65535] (0 picks a free port)"
            )
        check(
            self.port == 0 or self.port != self.store_port,
            "cluster.lighthouse.store_port",
            self.store_port,
            f"must differ from cluster.lighthouse.port={self.port} (or be 0 to pick a free port)",
        )
        check(self.history >= 1, "cluster.lighthouse.history", self.history, "must be >= 1 (quorums kept for /status)")

    def url(self, port: int | None = None) -> str:
        """Where the lighthouse answers HTTP; ``port``: the one it bound, where ``self.port`` is 0."""
        return f"http://{self.host}:{self.port if port is None else port}"

    def check_bind(self) -> None:
        """A lighthouse listening beyond loopback requires a token (docs/design.md, invariant 8)."""
        check(
            bool(self.token) or is_loopback(self.host),
            "cluster.lighthouse.host",
            self.host,
            "listens beyond loopback, which needs the job's token: put it in a file and pass "
            f"cluster.lighthouse.token_file=PATH (or set {TOKEN_ENV}), or listen on 127.0.0.1",
        )


def group_name(group: int) -> str:
    """Replica group ``group``'s id as the lighthouse sees it (its quorums, end holders, status page)."""
    return f"group{group}"


def group_id(name: str) -> int | None:
    """The id ``group_name`` made ``name`` from; None for a name of one's own (a test's, a script's)."""
    digits = name.removeprefix("group")
    return int(digits) if digits != name and digits.isdigit() else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (a name other than localhost may resolve beyond it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TimeoutsConfig:
    """Seconds; every wait in the system is bounded by one of these.

    ``connect``: peers and stores to appear; ``collective``: one all-reduce or state transfer;
    ``quorum``: a leader's wait for a quorum; ``heartbeat``: silence after which a group is
    dropped; ``join``: the least the first asker waits for the other healthy groups (longer,
    up to ``heartbeat``, while they ask far apart: ``diloco.ft.quorum.join_wait``);
    ``start``: how long a job's first quorum waits for every configured group; ``end``: how
    long groups that finished wait for the others to finish before the job ends; ``stop``: how
    long a planned stop (Ctrl-C) waits for the groups to finish their round and save;
    ``recovery``: how much longer than its predicted return the survivors' rounds wait for a
    dead group's replacement (when the launcher chose to wait for it); ``lighthouse``: how long
    a local job's lighthouse may leave /alive unanswered before the launcher replaces it (hung);
    ``stopped``: how long a worker may stay stopped (SIGSTOP, SIGTSTP) before it is killed and its
    group restarted (a group with a stopped worker cannot go on): by the local launcher, or under
    torchrun by the group's guard, after which the agent restarts the group; ``sit_out``: how long a
    group is left out of rounds after rounds with it failed twice in a row (two groups that cannot
    reach each other, a link too slow for the collective timeout), doubling each time it sits out
    again (``diloco.ft.quorum.QuorumBook.sit_out``), and how long a pair of groups that was cut apart more
    than once must reach each other again before they meet in a round (doubling per cut; a pair cut once
    meets again at once); ``probe``: how long a group leader's connect to a peer may take before the peer
    counts as unreachable from it (``diloco.ft.reach``); ``launch``: how long a local job keeps replacing
    a fork server killed or stopped before it started a process, or a lighthouse before it served (the
    job's start included), with backoff.
    """

    connect: float = 60.0
    collective: float = 30.0
    quorum: float = 60.0
    heartbeat: float = 3.0
    join: float = 0.5
    start: float = 60.0
    end: float = 120.0
    stop: float = 90.0  # > quorum: a group waiting on a quorum its peers left gets no answer before that
    recovery: float = 1.0
    lighthouse: float = 10.0
    stopped: float = 30.0  # < end: a group stopped just before the end still comes back for it
    sit_out: float = 60.0
    probe: float = 2.0
    launch: float = 120.0

    def validate(self) -> None:
        for key in fields(self):
            value = getattr(self, key.name)
            check(value > 0, f"cluster.timeouts.{key.name}", value, "must be > 0 seconds")

    @property
    def control(self) -> float:
        """How long a rank waits on its own group's control messages (the quorum answer, commit votes).

        It must outwait the longest its peers may legitimately be away in between: the leader's
        quorum long-poll (``quorum`` plus the ``connect`` slack of its HTTP call) or a lane's
        rendezvous and transfers (``connect`` plus ``collective``). At ``collective`` alone, a
        leader kept waiting by a slow or hung peer group killed its own healthy followers.
        """
        return max(self.quorum, self.collective) + self.connect


@dataclass(frozen=True)
class ClusterConfig:
    """M replica groups of N workers; ``master_addr`` is where a group's workers rendezvous."""

    groups: int = 2
    workers_per_group: int = 2
    min_groups: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    master_addr: str = "127.0.0.1"
    max_restarts: int = 5  # crashes in a row without progress (of a group, of the lighthouse) before the job fails
    restart_backoff: float = 1.0  # seconds before restarting a dead group, doubling per crash
    # How the local launcher starts workers: forked from a warm fork server (a restart costs
    # a fork, not seconds of imports; Linux only) or exec'd as a fresh python each.
    spawn: Literal["fork", "exec"] = "fork"
    # Warm spares the local launcher keeps built and waiting: a dead group is replaced by one at
    # once (diloco.worker.spares) instead of by fresh workers after the backoff. Each is N processes.
    spares: int = 0
    # At a group's death (local launcher): wait for its replacement or go on without it; auto
    # picks the cheaper by the performance model (diloco/launch/recovery.py).
    recovery: Literal["auto", "wait", "go_on"] = "auto"
    # Caps each worker's outer-round traffic (megabits per second, a token bucket): a slow link
    # on loopback, or politeness on a shared one. 0: unlimited.
    lane_bandwidth_mbps: float = 0.0
    # One device's peak TFLOP/s, the denominator of MFU (train/mfu). 0: a known GPU's bf16 dense
    # figure from its data sheet; on CPU, one core's matmul measured by the local launcher times a
    # worker's share of the cores; else a matmul measured by each worker (diloco/train/flops.py).
    peak_tflops: float = 0.0
    # A group whose link its leader's probes time at under 1/slow_link_factor of the median of the
    # others', and which would add over a tenth of the interval between rounds to each, sits out of
    # training rounds while that lasts (an all-reduce moves at its slowest link; docs/fault-tolerance.md,
    # "A slow link"). 0: never.
    slow_link_factor: float = 4.0
    lighthouse: LighthouseConfig = field(default_factory=LighthouseConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)

    def validate(self) -> None:
        check(self.groups >= 1, "cluster.groups", self.groups, "must be a positive integer")
        check(
            self.workers_per_group >= 1,
            "cluster.workers_per_group",
            self.workers_per_group,
            "must be a positive integer",
        )
        check(
            1 <= self.min_groups <= self.groups,
            "cluster.min_groups",
            self.min_groups,
            f"must be in [1, cluster.groups={self.groups}]",
        )
        check(self.max_restarts >= 0, "cluster.max_restarts", self.max_restarts, "must be >= 0")
        check(self.spares >= 0, "cluster.spares", self.spares, "must be >= 0 (warm spares kept by the local launcher)")
        check(
            self.lane_bandwidth_mbps >= 0,
            "cluster.lane_bandwidth_mbps",
            self.lane_bandwidth_mbps,
            "must be >= 0 megabits per second (0: unlimited)",
        )
        check(
            self.peak_tflops >= 0,
            "cluster.peak_tflops",
            self.peak_tflops,
            "must be >= 0 TFLOP/s per device (0: from the GPU's name, else measured)",
        )
        check(self.restart_backoff >= 0, "cluster.restart_backoff", self.restart_backoff, "must be >= 0 seconds")
        check(
            self.slow_link_factor == 0 or self.slow_link_factor > 1,
            "cluster.slow_link_factor",
            self.slow_link_factor,
            "must be 0 (off) or > 1 (how many times slower than the others' a link may be)",
        )
        self.lighthouse.validate()
        self.timeouts.validate()
        self.quorum_rules().validate()

    def quorum_rules(self) -> QuorumRules:
        return QuorumRules(
            min_groups=self.min_groups,
            join_timeout_s=self.timeouts.join,
            heartbeat_timeout_s=self.timeouts.heartbeat,
            expected_groups=self.groups,
            start_timeout_s=self.timeouts.start,
            end_timeout_s=self.timeouts.end,
            sit_out_s=self.timeouts.sit_out,
            slow_link_factor=self.slow_link_factor,
        )


@dataclass(frozen=True)
class QuorumRules:
    """``min_groups`` must ask before any quorum forms; ``join_timeout_s`` is the least the
    first asker waits for the rest (``join_wait`` in ``diloco.ft.quorum`` lengthens it, up to
    ``heartbeat_timeout_s``, while groups ask far apart); a group silent for
    ``heartbeat_timeout_s`` is dropped; one that rounds keep failing with sits out for ``sit_out_s``
    (doubling each time it does again); one whose link is timed under ``1 / slow_link_factor`` of the
    others' and holds rounds up sits out while it does (0: never; ``Reachability.slow_links``).

    ``expected_groups`` is the job's number of groups (0: unknown, which turns off the two
    waits it allows): a job's first quorum waits up to ``start_timeout_s`` for all of them,
    so no window is lost to a slow start; finished groups wait up to ``end_timeout_s`` for
    the rest to finish before the job ends.
    """

    min_groups: int = 1
    join_timeout_s: float = 5.0
    heartbeat_timeout_s: float = 10.0
    expected_groups: int = 0
    start_timeout_s: float = 60.0
    end_timeout_s: float = 120.0
    sit_out_s: float = 60.0
    slow_link_factor: float = 0.0

    def validate(self) -> None:
        check(self.min_groups >= 1, "cluster.min_groups", self.min_groups, "must be a positive integer")
        check(self.join_timeout_s > 0, "cluster.timeouts.join", self.join_timeout_s, "must be > 0 seconds")
        check(
            self.heartbeat_timeout_s > 0,
            "cluster.timeouts.heartbeat",
            self.heartbeat_timeout_s,
            "must be > 0 seconds",
        )
        check(self.expected_groups >= 0, "cluster.groups", self.expected_groups, "must be a positive integer")
        check(self.start_timeout_s > 0, "cluster.timeouts.start", self.start_timeout_s, "must be > 0 seconds")
        check(self.end_timeout_s > 0, "cluster.timeouts.end", self.end_timeout_s, "must be > 0 seconds")
        check(self.sit_out_s > 0, "cluster.timeouts.sit_out", self.sit_out_s, "must be > 0 seconds")
