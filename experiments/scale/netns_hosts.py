"""A multi-host job on one machine: each host a network namespace, faults injected between hosts.

tests/launch/test_multihost.py runs a multi-host job's parts (a lighthouse, each group under
torchrun) on loopback, where no fault between hosts can be made. Here each host is a Linux network
namespace with an address of its own (``NetnsHosts``): a veth ``lnk`` in each, whose other end is
a port of bridge ``br0`` in a hub namespace, so every packet between hosts crosses a link this
harness can take down (``link_down``), cut between two hosts (``partition``) or slow (``shape``, a
tbf on both ends, as ``netns_link.NetnsLink``), while its processes run on. ``MultihostJob`` runs
a job on them exactly as docs/fault-tolerance.md ("Many hosts") and experiments/fault_tolerance/multihost.sbatch
say: a token file, the lighthouse on host ``lh`` under a restart loop, group g under
``torchrun --standalone`` on host ``g{g}``, all writing one run directory (the namespaces split the
network only: they share the filesystem), and kills hosts, lighthouses and workers.

Faults are silent, as on a real network: every host holds a permanent neighbour (ARP) entry for
every other, so no address resolution can fail and turn a lost host into a quick "no route to
host"; a packet that cannot cross is dropped, and a connect to it times out instead of being
refused, an open TCP connection hangs (and resumes once the link is back) instead of being reset.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2); ``unavailable()``
(from netns_link) says in one line why not. Names carry the creating pid and a random tag, as
netns_link's do (``remove_stale`` deletes the namespaces of either once their run is gone); on exit,
also on Ctrl-C or an error, every process left in a host is killed and every namespace deleted.

    python -m experiments.scale.netns_hosts      # a fault-free 2-group job across 3 hosts; exit 0 if ok
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from experiments.communication.netns_link import (
    LINK_IF,
    PREFIX,
    Namespaces,
    NetnsError,
    _alive,
    _delete,
    _ip,
    _run,
    pick_subnet,
    tbf_args,
)

REPO = Path(__file__).resolve().parents[2]
LIGHTHOUSE = "lh"  # the host MultihostJob runs the lighthouse on; group g runs on host f"g{g}"
LIGHTHOUSE_PORT = 29510  # as the docs' example: each host has ports of its own, so runs never clash
KILL_WAIT_S = 10.0  # how long kill_host waits for a host's processes to be gone
LEFTOVER_GRACE_S = 5.0  # how long a helper may outlive the part that started it
TAIL_CHARS = 3000  # of each part's log, in what wait() returns
# The lighthouse as multihost.sbatch runs it: restarted until it exits 0 (the job ended).
RESTART_LOOP = 'until "$@"; do echo "lighthouse died; restarting"; sleep 1; done'


def mac_for(address: str) -> str:
    """A host's MAC: locally administered, unicast, and its IPv4 address in the last four bytes."""
    return "02:00:" + ":".join(f"{byte:02x}" for byte in ipaddress.IPv4Address(address).packed)


def _taken_networks() -> list[str]:
    """The root namespace's routes (as netns_link picks its subnet): the hosts' /24 stays apart."""
    routes = [line.split()[0] for line in _run("ip", "-4", "route", "show", "table", "all").splitlines() if line]
    return [r for r in routes if r[0].isdigit() or r == "default"]


class NetnsHosts(Namespaces):
    """A namespace per name in ``names``, each on the hub's bridge; ``mbps`` (one rate, or a rate
    per name; 0 or missing: unshaped) shapes a host's link both ways. For a ``with`` block.

    Partitions are made with neighbour entries, not ``tc`` filters (this kernel has no ``flower``
    classifier, and no ``gact`` action for ``u32`` to drop with): ``partition(a, b)`` points a's entry for b,
    and b's for a, at a MAC that no host has (``mac_for`` of the subnet's network address). Their
    frames still cross the bridge, which floods them (an address it never learned) to every other
    host, where they are dropped as addressed to another; nothing answers, so both sides see a
    silent drop, while each still reaches every other host.
    """

    def __init__(self, names: Sequence[str], mbps: float | dict[str, float] = 0) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"need distinct host names, got {list(names)}")
        rates = mbps if isinstance(mbps, dict) else dict.fromkeys(names, mbps)
        if set(rates) - set(names) or any(rate < 0 for rate in rates.values()):
            raise ValueError(f"rates for hosts {sorted(rates)} of {list(names)}: each >= 0 Mbit/s, of a named host")
        self.names = list(names)
        self._rates = {name: rates.get(name, 0) for name in names}
        tag = secrets.token_hex(3)
        self.hub = f"{PREFIX}-{os.getpid()}-{tag}-hub"
        self._namespaces = {name: f"{PREFIX}-{os.getpid()}-{tag}-h{i}" for i, name in enumerate(names)}
        self._hub_ends = {name: f"h{i}" for i, name in enumerate(names)}  # in the hub, on br0
        self._tag = int(tag, 16)
        self._made: list[str] = []  # namespaces created so far, deleted on exit
        self._started: dict[str, list[subprocess.Popen]] = {name: [] for name in names}
        self.subnet: ipaddress.IPv4Network | None = None

    def namespace(self, name: str) -> str:
        return self._namespaces[name]

    def address(self, name: str) -> str:
        return str(self.subnet[1 + self.names.index(name)])

    def prefix(self, name: str) -> list[str]:
        """What a command runs under on host ``name``: in its namespace, Gloo on its veth (Gloo
        picks its interface from the host name otherwise, which every namespace shares)."""
        return ["ip", "netns", "exec", self._namespaces[name], "env", f"GLOO_SOCKET_IFNAME={LINK_IF}"]

    def popen(
        self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None, **popen_kwargs: Any
    ) -> subprocess.Popen:
        """Start ``argv`` on host ``name``, with ``env`` added to this environment, in a session of
        its own. ``ip netns exec`` and ``env`` exec, so the Popen's pid is ``argv``'s process."""
        process = subprocess.Popen(
            [*self.prefix(name), *argv],
            env={**os.environ, **(env or {})},
            start_new_session=True,
            **popen_kwargs,
        )
        self._started[name].append(process)
        return process

    def pids(self, name: str) -> list[int]:
        """Every live process in host ``name``'s namespace."""
        listed = _run("ip", "netns", "pids", self._namespaces[name]).split()
        return [pid for pid in map(int, listed) if _alive(pid)]

    def kill_host(self, name: str) -> None:
        """SIGKILL every process on host ``name`` (a host lost: agents and workers alike) until none
        is left, reaping those this harness started; ``NetnsError`` after ``KILL_WAIT_S``."""
        deadline = time.monotonic() + KILL_WAIT_S
        while pids := self.pids(name):
            if time.monotonic() > deadline:
                raise NetnsError(f"host {name}: processes {pids} outlived SIGKILL for {KILL_WAIT_S:.0f} s")
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.05)
        for process in self._started[name]:
            process.wait(timeout=KILL_WAIT_S)

    def link_down(self, name: str) -> None:
        """Take host ``name``'s link down at the bridge: its processes run on, nothing crosses."""
        _ip(self.hub, "link", "set", self._hub_ends[name], "down")

    def link_up(self, name: str) -> None:
        _ip(self.hub, "link", "set", self._hub_ends[name], "up")

    def partition(self, a: str, b: str) -> None:
        """Hosts ``a`` and ``b`` no longer reach each other (silently; see the class docstring)."""
        nowhere = mac_for(str(self.subnet.network_address))
        self._neighbour(a, b, nowhere)
        self._neighbour(b, a, nowhere)

    def heal(self, a: str, b: str) -> None:
        self._neighbour(a, b, mac_for(self.address(b)))
        self._neighbour(b, a, mac_for(self.address(a)))

    def shape(self, name: str, mbps: float) -> None:
        """Set host ``name``'s link to ``mbps`` both ways (a tbf on each end); 0 unshapes it."""
        if mbps < 0:
            raise ValueError(f"a rate is >= 0 Mbit/s (0: unshaped), got {mbps}")
        for namespace, dev in ((self._namespaces[name], LINK_IF), (self.hub, self._hub_ends[name])):
            tc = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
            if mbps > 0:
                _run(*tc, "replace", "dev", dev, "root", *tbf_args(mbps))
            elif self._rates[name] > 0:
                _run(*tc, "del", "dev", dev, "root")
        self._rates[name] = mbps

    def _neighbour(self, host: str, peer: str, mac: str) -> None:
        """Host ``host`` sends what is for ``peer`` to ``mac``, for good (no ARP ever asks)."""
        entry = ["neigh", "replace", self.address(peer), "lladdr", mac, "dev", LINK_IF, "nud", "permanent"]
        _ip(self._namespaces[host], *entry)

    def _build(self) -> None:
        self.subnet = pick_subnet(_taken_networks(), self._tag)
        if len(self.names) > self.subnet.num_addresses - 2:
            raise ValueError(f"{len(self.names)} hosts do not fit in a /24")
        self._netns(self.hub)
        _ip(self.hub, "link", "add", "br0", "type", "bridge")
        _ip(self.hub, "link", "set", "br0", "up")
        for name in self.names:
            namespace, hub_end, address = self._namespaces[name], self._hub_ends[name], self.address(name)
            self._netns(namespace)
            veth = ["link", "add", LINK_IF, "address", mac_for(address), "type", "veth"]
            _ip(namespace, *veth, "peer", "name", hub_end, "netns", self.hub)
            _ip(namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", LINK_IF)
            _ip(namespace, "link", "set", LINK_IF, "up")
            _ip(self.hub, "link", "set", hub_end, "master", "br0", "up")
            self._rates[name], rate = 0, self._rates[name]  # the new link has no qdisc yet
            self.shape(name, rate)
        for host in self.names:
            for peer in self.names:
                if peer != host:
                    self._neighbour(host, peer, mac_for(self.address(peer)))

    def close(self) -> None:
        """Kill every process left on a host, then delete every namespace made (their veth ends
        and qdiscs go with them). A namespace deleted with processes in it would live on in them."""
        errors = []
        for name in self.names:
            if self._namespaces[name] in self._made:
                try:
                    self.kill_host(name)
                except (NetnsError, subprocess.TimeoutExpired) as error:
                    errors.append(str(error))
        errors += [_delete("ip", "netns", "del", name) for name in reversed(self._made)]
        self._made.clear()
        errors = [e for e in errors if e is not None]
        if errors:  # said, not raised: an exit on an error must not hide that error
            print(f"netns_hosts: could not clean up {'; '.join(errors)}", file=sys.stderr)


@dataclass(frozen=True)
class Ended:
    """How one part of a job ended: its exit code (negative: the signal that killed it), whether
    ``wait`` killed it at its timeout, and the last ``TAIL_CHARS`` of its log."""

    returncode: int
    killed: bool
    tail: str


def job_options(
    *, name: str, groups: int, workers_per_group: int, lighthouse: str, token_file: Path, run_dir: Path
) -> list[str]:
    """The overrides every part of the job is given (as tests/launch/test_multihost.py's), dialing
    or (``0.0.0.0``) binding the lighthouse at ``lighthouse``."""
    return [
        f"name={name}",
        f"cluster.groups={groups}",
        f"cluster.workers_per_group={workers_per_group}",
        "cluster.device=cpu",
        "logger=none",
        "trainer.eval_every=0",
        "trainer.eval_batches=2",
        f"cluster.lighthouse.token_file={token_file}",
        f"cluster.lighthouse.port={LIGHTHOUSE_PORT}",
        f"cluster.lighthouse.host={lighthouse}",
        f"hydra.run.dir={run_dir}",
    ]


def lighthouse_command(python: str, options: Sequence[str]) -> list[str]:
    """The lighthouse under multihost.sbatch's restart loop (bash runs it again until it exits 0)."""
    return ["bash", "-c", RESTART_LOOP, "lighthouse", python, "run.py", "role=lighthouse", *options]


def group_command(python: str, group: int, nproc: int, max_restarts: int, options: Sequence[str]) -> list[str]:
    """Group ``group``'s torchrun, as the docs run it (``python -m``: the torchrun of ``python``)."""
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*torchrun, "--max-restarts", str(max_restarts), "run.py", "role=group", f"group.id={group}", *options]


def _signal(pid: int, signum: signal.Signals) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _parent(int(entry)) == pid and _alive(int(entry)):
            found.append(int(entry))
    return sorted(found)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _local_rank(pid: int) -> int | None:
    """The worker's ``LOCAL_RANK`` (torchrun sets it in each worker's environment)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            variables = environ.read().split(b"\0")
    except OSError:
        return None
    return next((int(v.split(b"=", 1)[1]) for v in variables if v.startswith(b"LOCAL_RANK=")), None)


def _tail(path: Path) -> str:
    with open(path, "rb") as log:
        log.seek(max(0, path.stat().st_size - TAIL_CHARS))
        return log.read().decode(errors="replace")


def _poll_until(found: Callable[[], list[int]], timeout_s: float, what: str) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not (pids := found()):
        if time.monotonic() > deadline:
            raise LookupError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.1)
    return pids


class MultihostJob:
    """A job on ``hosts`` (``lh`` and ``g0``..): ``groups`` groups of ``workers_per_group`` under
    torchrun (restarting its workers up to ``max_restarts`` times), given ``overrides`` after the
    common options, writing ``work_dir``/run; each part's output goes to ``work_dir``/logs/PART.log
    (a file, which cannot fill up as a pipe would; appended to when a part is started again), the
    token to ``work_dir``/job.token (0600, outside the run directory). ``start()`` starts every
    part; ``wait()`` collects them; leaving the ``with`` block kills whatever is left.
    """

    def __init__(
        self,
        hosts: NetnsHosts,
        work_dir: Path,
        *,
        groups: int,
        workers_per_group: int = 1,
        overrides: Sequence[str] = (),
        max_restarts: int = 0,
        name: str = "netns",
    ) -> None:
        needed = [LIGHTHOUSE, *(f"g{g}" for g in range(groups))]
        if groups < 1 or workers_per_group < 1 or not set(needed) <= set(hosts.names):
            raise ValueError(f"{groups} groups of {workers_per_group} need hosts {needed}; got {hosts.names}")
        self.hosts = hosts
        self.groups = groups
        self.workers_per_group = workers_per_group
        self.max_restarts = max_restarts
        self.run_dir = work_dir / "run"
        self.log_dir = work_dir / "logs"
        self.token_file = work_dir / "job.token"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as token:
            token.write(secrets.token_hex(16) + "\n")
        common = {"name": name, "groups": groups, "workers_per_group": workers_per_group}
        common |= {"token_file": self.token_file, "run_dir": self.run_dir}
        self._options = job_options(lighthouse=hosts.address(LIGHTHOUSE), **common) + list(overrides)
        self._lighthouse_options = job_options(lighthouse="0.0.0.0", **common) + list(overrides)
        self._parts: dict[str, subprocess.Popen] = {}  # the latest start of each part, by host
        self._logs: list[IO[bytes]] = []

    def start(self) -> None:
        self.start_lighthouse()
        for group in range(self.groups):
            self.start_group(group)

    def start_lighthouse(self) -> None:
        self._start(LIGHTHOUSE, lighthouse_command(sys.executable, self._lighthouse_options), {})

    def start_group(self, group: int) -> None:
        """Start group ``group``'s torchrun on its host (again, after ``kill_host``, say)."""
        argv = group_command(sys.executable, group, self.workers_per_group, self.max_restarts, self._options)
        # Every host shares this machine's cores: one thread per worker, or they spin taking turns.
        self._start(f"g{group}", argv, {"OMP_NUM_THREADS": "1"})

    def _start(self, host: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.log_dir / f"{host}.log", "ab")  # noqa: SIM115 - closed by close()
        self._logs.append(log)
        log.write(f"== {time.strftime('%H:%M:%S')} started: {' '.join(argv)}\n".encode())
        log.flush()
        kwargs = {"stdin": subprocess.DEVNULL, "stdout": log, "stderr": subprocess.STDOUT, "cwd": REPO}
        self._parts[host] = self.hosts.popen(host, argv, env=env, **kwargs)

    def lighthouse_pids(self) -> list[int]:
        """The lighthouse's python (the loop's child running run.py; none while the loop sleeps)."""
        loop = self._parts[LIGHTHOUSE].pid
        return [pid for pid in _children(loop) if "role=lighthouse" in _argv(pid)]

    def kill_lighthouse(self, timeout_s: float = 30.0) -> int:
        """SIGKILL the lighthouse's python, not its loop (which starts it again); its pid."""
        pid = _poll_until(self.lighthouse_pids, timeout_s, "lighthouse process")[0]
        _signal(pid, signal.SIGKILL)
        return pid

    def worker_pids(self, group: int) -> list[int]:
        """Group ``group``'s workers: the torchrun agent's children running run.py role=group (a
        worker's own helpers are the agent's grandchildren)."""
        agent = self._parts[f"g{group}"].pid
        return [pid for pid in _children(agent) if {"run.py", "role=group"} <= set(_argv(pid))]

    def kill_worker(self, group: int, local_rank: int | None = None, timeout_s: float = 30.0) -> int:
        """SIGKILL one worker of ``group`` (``local_rank``'s, or any); its pid."""
        pid = self._worker(group, local_rank, timeout_s)
        _signal(pid, signal.SIGKILL)
        return pid

    def stop_worker(self, group: int, local_rank: int | None = None, timeout_s: float = 30.0) -> int:
        """SIGSTOP one worker of ``group`` (never resumed: a worker hung); its pid."""
        pid = self._worker(group, local_rank, timeout_s)
        _signal(pid, signal.SIGSTOP)
        return pid

    def _worker(self, group: int, local_rank: int | None, timeout_s: float) -> int:
        def matching() -> list[int]:
            pids = self.worker_pids(group)
            return [p for p in pids if local_rank is None or _local_rank(p) == local_rank]

        what = f"worker of group {group}" + ("" if local_rank is None else f" at local rank {local_rank}")
        return _poll_until(matching, timeout_s, what)[0]

    def wait(self, timeout_s: float) -> dict[str, Ended]:
        """Each part's end, by host (``lh``: the lighthouse's loop, ``g0``..: each group's torchrun
        as last started); a part still running after ``timeout_s`` is killed with its host."""
        deadline = time.monotonic() + timeout_s
        killed = set()
        for host, process in self._parts.items():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.hosts.kill_host(host)
                killed.add(host)
        self._close_logs()
        return {
            host: Ended(p.returncode, host in killed, _tail(self.log_dir / f"{host}.log"))
            for host, p in self._parts.items()
        }

    def summary(self) -> dict | None:
        """The job's summary.json (the lighthouse writes it once the job ended); None before."""
        path = self.run_dir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    def leftovers(self, grace_s: float = LEFTOVER_GRACE_S) -> list[int]:
        """Every process still running on any host of the job ``grace_s`` after the call (sooner
        once none is): a helper may outlive its part by a poll (the stopped guard: up to a second)."""
        deadline = time.monotonic() + grace_s
        while (left := sorted(pid for host in self._parts for pid in self.hosts.pids(host))) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.1)
        return left

    def __enter__(self) -> MultihostJob:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for host in self._parts:
            self.hosts.kill_host(host)
        self._close_logs()

    def _close_logs(self) -> None:
        for log in self._logs:
            log.close()
        self._logs.clear()


def main() -> int:
    """A fault-free job: 2 groups x 1 worker on hosts g0, g1, the lighthouse on lh."""
    overrides = ["trainer.max_steps=60", "algo.sync_every=10"]
    with tempfile.TemporaryDirectory(prefix="netns_hosts-") as work, NetnsHosts([LIGHTHOUSE, "g0", "g1"]) as hosts:
        print(f"hosts: {', '.join(f'{n} {hosts.address(n)}' for n in hosts.names)}")
        started = time.monotonic()
        with MultihostJob(hosts, Path(work), groups=2, overrides=overrides) as job:
            job.start()
            ended = job.wait(timeout_s=300)
            summary = job.summary()
        for host, end in ended.items():
            print(f"{host}: exit {end.returncode}{' (killed at the timeout)' if end.killed else ''}")
            if end.returncode != 0:
                print(end.tail)
        print(f"{time.monotonic() - started:.1f} s")
        if summary is None:
            print("no summary.json")
            return 1
        digests = sorted({r["digest"] for r in summary["per_group"]})
        print(f"ok: {summary['ok']}, final round {summary['final_round']}, digests {digests}")
        if not summary["ok"]:
            print(f"failure: {summary['failure']}")
        return 0 if summary["ok"] and all(e.returncode == 0 for e in ended.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
