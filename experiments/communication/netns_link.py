"""A kernel-shaped link between replica groups: each group in its own network namespace.

``cluster.lane_bandwidth_mbps`` paces each worker's outer traffic with an in-process token
bucket, on loopback. To check ``algo.auto`` and ``diloco/outer/perf_model.py`` against a real
link as well, ``NetnsLink`` puts each group's workers in a network namespace of their own,
joined by veth pairs to a bridge in a hub namespace, with a ``tc`` token bucket filter (tbf; this
kernel has no netem) on both ends of every group's veth: what a group sends and what it receives
are each limited to the rate, as on a symmetric access link. The hub is a namespace of its own so
that traffic between groups never crosses the root namespace's netfilter (Docker's
``FORWARD DROP`` with ``br_netfilter``); the root namespace joins the bridge through one more
veth, whose address the lighthouse (and its lane store) listen on.

How workers get in: the local launcher exec's each of a group's workers under ``ip netns exec
NS env GLOO_SOCKET_IFNAME=lnk`` (``LocalCluster``'s ``worker_prefix``, ``cluster.spawn=exec``).
``ip netns exec`` exec's, so the launcher keeps the worker's pid, and the process is in the
namespace before any socket exists; forked workers could not (a fork server's children share its
namespace), which is why the hook is a command prefix and not a ``setns`` in the fork server.
Gloo picks its interface from the host name, which resolves outside the namespace, so
``GLOO_SOCKET_IFNAME`` names the group's veth (``lnk`` in every namespace); within a group the
workers still reach each other over the namespace's own loopback.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc``; ``unavailable()`` says in one
line why not. Names carry the creating pid and a random tag, so parallel runs never clash; every
namespace is deleted on exit (deleting one deletes its veth ends), on Ctrl-C and on an error
too, and namespaces left by a killed run (pid gone) are deleted by the next one.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import sys
from types import TracebackType
from typing import TypeVar

LINK_IF = "lnk"  # a group's veth, inside its namespace (the same name in each)
PREFIX = "dlk"  # of every namespace and root-namespace interface this module makes
BURST_S = 0.05  # tbf bucket depth in seconds of the rate, as the in-process TokenBucket's burst
MIN_BURST_BYTES = 3200  # at least two full frames, or tbf cannot send a 1514-byte packet at all
LATENCY_MS = 100  # how long a packet may queue before tbf drops it (TCP then backs off)
SUBNET_TRIES = 256
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21  # <linux/capability.h>
_NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-(?:hub|[gh]\d+)$")  # h: netns_hosts.py's hosts


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message names it and its stderr."""


def unavailable() -> str | None:
    """Why a shaped link cannot be built here, in one line; None if it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth pairs and tc qdiscs need CAP_NET_ADMIN and CAP_SYS_ADMIN"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    if not _has_capabilities(CAP_NET_ADMIN, CAP_SYS_ADMIN):
        return "root without CAP_NET_ADMIN and CAP_SYS_ADMIN (an unprivileged container?)"
    return None


def _has_capabilities(*caps: int) -> bool:
    with open("/proc/self/status") as status:
        effective = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    return all(effective >> cap & 1 for cap in caps)


def tbf_args(mbps: float) -> list[str]:
    """``tc qdisc add dev DEV root`` + these: a tbf at ``mbps`` megabits per second.

    The bucket holds ``BURST_S`` of the rate, but never less than two full frames (a bucket
    smaller than a packet would never send it); packets queue up to ``LATENCY_MS``.
    """
    if mbps <= 0:
        raise ValueError(f"a tbf needs a positive rate, got {mbps} Mbit/s (0 is unlimited: no qdisc)")
    rate_bps = round(mbps * 1e6)
    burst = max(MIN_BURST_BYTES, round(rate_bps / 8 * BURST_S))
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", f"{LATENCY_MS}ms"]


def pick_subnet(taken: list[str], tag: int) -> ipaddress.IPv4Network:
    """A /24 in 10.128.0.0/9 overlapping none of the ``taken`` networks (the root namespace's
    routes, default excluded), starting from ``tag`` so parallel runs start apart."""
    used = [ipaddress.ip_network(n, strict=False) for n in taken if n != "default"]
    pool = ipaddress.ip_network("10.128.0.0/9")
    count = pool.num_addresses // 256
    for i in range(SUBNET_TRIES):
        net = ipaddress.ip_network((int(pool.network_address) + (tag + i) % count * 256, 24))
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError(f"no free /24 in {pool} among {SUBNET_TRIES} tried for the shaped link")


def _run(*argv: str) -> str:
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _ip(namespace: str, *args: str) -> str:
    """``ip ARGS`` inside ``namespace``."""
    return _run("ip", "-n", namespace, *args)


def _delete(*argv: str) -> str | None:
    """Run an ``ip ... del``; its error, if any, for a cleanup that goes on regardless."""
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    return None if done.returncode == 0 else f"{argv[-1]}: {done.stderr.strip()}"


def remove_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (killed before it could clean up)."""
    removed = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAMESPACE.match(name)
        if match and not _alive(int(match.group(1))):
            _delete("ip", "netns", "del", name)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


Built = TypeVar("Built", bound="Namespaces")  # the subclass a with block built (typing.Self needs 3.11)


class Namespaces:
    """Namespaces made for a ``with`` block: the stale ones of killed runs deleted first, then
    ``_build()``; on exit, also on Ctrl-C or an error mid-build, ``close()`` deletes them."""

    _made: list[str]  # namespaces created so far, deleted on exit

    def __enter__(self: Built) -> Built:
        remove_stale()
        try:
            self._build()
        except BaseException:  # Ctrl-C included: nothing half-built stays behind
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _ip(name, "link", "set", "lo", "up")

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class NetnsLink(Namespaces):
    """``groups`` namespaces behind a ``mbps`` link (0: unshaped veths), for a ``with`` block.

    ``host`` is the root namespace's address on the link (the lighthouse listens there);
    ``worker_prefix()`` is what ``LocalCluster`` runs each group's workers under.
    """

    def __init__(self, groups: int, mbps: float) -> None:
        if groups < 1 or mbps < 0:
            raise ValueError(f"need groups >= 1 and mbps >= 0, got {groups}, {mbps}")
        self.groups = groups
        self.mbps = mbps
        tag = secrets.token_hex(3)
        self.hub = f"{PREFIX}-{os.getpid()}-{tag}-hub"
        self.namespaces = [f"{PREFIX}-{os.getpid()}-{tag}-g{g}" for g in range(groups)]
        self.root_if = f"{PREFIX}{tag}"  # 9 characters: interface names end at 15
        self._tag = int(tag, 16)
        self._made: list[str] = []  # namespaces created so far, deleted on exit
        self._root_if_made = False
        self.subnet: ipaddress.IPv4Network | None = None

    @property
    def host(self) -> str:
        return str(self.subnet[1])

    def address(self, group: int) -> str:
        return str(self.subnet[2 + group])

    def prefix(self, group: int) -> list[str]:
        """The command a worker of ``group`` runs under: in its namespace, Gloo on its veth."""
        return ["ip", "netns", "exec", self.namespaces[group], "env", f"GLOO_SOCKET_IFNAME={LINK_IF}"]

    def worker_prefix(self) -> dict[int, list[str]]:
        return {g: self.prefix(g) for g in range(self.groups)}

    def _shape(self, namespace: str, dev: str) -> None:
        if self.mbps > 0:
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", dev, "root", *tbf_args(self.mbps))

    def _build(self) -> None:
        routes = [line.split()[0] for line in _run("ip", "-4", "route", "show", "table", "all").splitlines() if line]
        self.subnet = pick_subnet([r for r in routes if r[0].isdigit() or r == "default"], self._tag)
        bits = self.subnet.prefixlen
        self._netns(self.hub)
        _ip(self.hub, "link", "add", "br0", "type", "bridge")
        _ip(self.hub, "link", "set", "br0", "up")
        # The root namespace's end: the lighthouse's address.
        _run("ip", "link", "add", self.root_if, "type", "veth", "peer", "name", "host", "netns", self.hub)
        self._root_if_made = True
        _ip(self.hub, "link", "set", "host", "master", "br0", "up")
        _run("ip", "addr", "add", f"{self.host}/{bits}", "dev", self.root_if)
        _run("ip", "link", "set", self.root_if, "up")
        for group, namespace in enumerate(self.namespaces):
            self._netns(namespace)
            hub_end = f"g{group}"
            _ip(namespace, "link", "add", LINK_IF, "type", "veth", "peer", "name", hub_end, "netns", self.hub)
            _ip(namespace, "addr", "add", f"{self.address(group)}/{bits}", "dev", LINK_IF)
            _ip(namespace, "link", "set", LINK_IF, "up")
            _ip(self.hub, "link", "set", hub_end, "master", "br0", "up")
            self._shape(namespace, LINK_IF)  # what the group sends
            self._shape(self.hub, hub_end)  # what it receives

    def close(self) -> None:
        """Delete every namespace made (their veth ends and qdiscs go with them) and the root's veth
        (at once: a namespace's devices go in the background, after ``ip netns del`` returns)."""
        errors = [_delete("ip", "link", "del", self.root_if)] if self._root_if_made else []
        self._root_if_made = False
        errors += [_delete("ip", "netns", "del", name) for name in reversed(self._made)]
        self._made.clear()
        errors = [e for e in errors if e is not None]
        if errors:  # said, not raised: an exit on an error must not hide that error
            print(f"netns_link: could not delete {'; '.join(errors)}", file=sys.stderr)
