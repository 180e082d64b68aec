"""experiments/scale/netns_hosts.py: the commands and options it builds (fast); a link taken down or a
partition between hosts that drops packets silently, and a host's link reshaped (slow; need root,
``ip`` and ``tc``). A job across the hosts, through faults, is test_multihost_netns.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.communication import netns_link
from experiments.scale import netns_hosts
from experiments.scale.netns_hosts import (
    MultihostJob,
    NetnsHosts,
    group_command,
    job_options,
    lighthouse_command,
    mac_for,
)

NO_NETNS = netns_link.unavailable()
needs_netns = pytest.mark.skipif(NO_NETNS is not None, reason=f"namespaced hosts: {NO_NETNS}")
PORT = 4242
# On a host: accept on PORT forever, echoing what each connection sends.
ECHO_SERVER = """
import socket, sys, threading
def echo(conn):
    while data := conn.recv(1 << 16):
        conn.sendall(data)
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""
# On a host: one connect with a timeout; prints how it went.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("connected")
except TimeoutError:
    print("timed out")
except OSError as error:
    print(type(error).__name__, error.errno)
"""
# On a host: one connection kept open; each line on stdin sends it and waits (up to the line's
# seconds) for the echo: "echoed", or "waiting" if none came (the connection neither reset nor closed).
HOLD = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print("connected", flush=True)
for line in sys.stdin:
    conn.settimeout(float(line))
    conn.sendall(b"x")
    try:
        print("echoed" if conn.recv(1) == b"x" else "closed", flush=True)
    except TimeoutError:
        print("waiting", flush=True)
"""


def test_mac_for_puts_the_address_in_a_locally_administered_unicast_mac():
    assert mac_for("10.128.5.3") == "02:00:0a:80:05:03"
    assert int(mac_for("10.0.0.1")[:2], 16) & 0b11 == 0b10, "locally administered, not multicast"


def test_lighthouse_runs_in_the_sbatch_restart_loop_and_groups_under_torchrun():
    loop = lighthouse_command("py", ["name=x"])
    assert loop[:2] == ["bash", "-c"] and loop[2].startswith('until "$@"; do') and "sleep 1" in loop[2]
    assert loop[4:] == ["py", "run.py", "role=lighthouse", "name=x"], "argv through $@: nothing to quote"
    group = group_command("py", 2, 4, 1, ["name=x"])
    assert group[:7] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--max-restarts"]
    assert group[7:] == ["1", "run.py", "role=group", "group.id=2", "name=x"]


def test_job_options_point_every_part_at_one_lighthouse_run_directory_and_token_file():
    options = job_options(
        name="j", groups=3, workers_per_group=2, lighthouse="10.1.2.3", token_file=Path("/t"), run_dir=Path("/r")
    )
    assert {"name=j", "cluster.groups=3", "cluster.workers_per_group=2", "hydra.run.dir=/r"} <= set(options)
    assert {"cluster.lighthouse.host=10.1.2.3", "cluster.lighthouse.token_file=/t", "logger=none"} <= set(options)
    assert f"cluster.lighthouse.port={netns_hosts.LIGHTHOUSE_PORT}" in options


def test_hosts_and_jobs_refuse_what_they_cannot_build(tmp_path):
    with pytest.raises(ValueError, match="distinct"):
        NetnsHosts(["a", "a"])
    with pytest.raises(ValueError, match="named host"):
        NetnsHosts(["a"], {"b": 1.0})
    hosts = NetnsHosts(["lh", "g0"])
    assert all(netns_link._NAMESPACE.match(hosts.namespace(n)) for n in hosts.names), "remove_stale finds them"
    assert netns_link._NAMESPACE.match(hosts.hub)
    with pytest.raises(ValueError, match=r"need hosts \['lh', 'g0', 'g1'\]"):
        MultihostJob(hosts, tmp_path, groups=2)


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout.split())


def _connect(hosts: NetnsHosts, source: str, target: str, timeout_s: float = 1.5) -> str:
    argv = [sys.executable, "-c", CONNECT, hosts.address(target), str(PORT), str(timeout_s)]
    return hosts.popen(source, argv, stdout=subprocess.PIPE, text=True).communicate(timeout=30)[0].strip()


def _serve(hosts: NetnsHosts, *names: str) -> None:
    for name in names:
        server = hosts.popen(
            name, [sys.executable, "-c", ECHO_SERVER, hosts.address(name), str(PORT)], stdout=subprocess.PIPE, text=True
        )
        assert server.stdout.readline().strip() == "listening"


@pytest.mark.slow
@needs_netns
def test_a_link_down_drops_silently_and_an_open_connection_resumes_once_it_is_up():
    with NetnsHosts(["lh", "g0", "g1"]) as hosts:
        _serve(hosts, "g1")
        assert _connect(hosts, "g0", "g1") == "connected"
        hold = hosts.popen(
            "g0",
            [sys.executable, "-c", HOLD, hosts.address("g1"), str(PORT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert hold.stdout.readline().strip() == "connected"
        hosts.link_down("g1")
        assert _connect(hosts, "g0", "g1") == "timed out", "dropped, not refused nor unreachable"
        assert _connect(hosts, "lh", "g1") == "timed out"
        assert _connect(hosts, "g1", "g0") == "timed out", "nothing leaves a downed link either"
        hold.stdin.write("1\n")
        hold.stdin.flush()
        assert hold.stdout.readline().strip() == "waiting", "the open connection hangs, neither reset nor closed"
        assert hosts.pids("g1"), "the cut-off host's processes run on"
        hosts.link_up("g1")
        hold.stdin.write("20\n")  # the retransmission of the first byte (its backoff: ~3 s on) is echoed
        hold.stdin.flush()
        assert hold.stdout.readline().strip() == "echoed"
        assert _connect(hosts, "g0", "g1") == "connected"
        hold.stdin.close()
    assert not _namespaces() & {hosts.hub, *map(hosts.namespace, hosts.names)}


@pytest.mark.slow
@needs_netns
def test_a_partition_cuts_two_hosts_apart_and_no_one_else():
    with NetnsHosts(["lh", "g0", "g1"]) as hosts:
        _serve(hosts, "lh", "g0", "g1")
        hosts.partition("g0", "g1")
        assert _connect(hosts, "g0", "g1") == "timed out"
        assert _connect(hosts, "g1", "g0") == "timed out"
        assert [_connect(hosts, a, b) for a, b in [("g0", "lh"), ("lh", "g0"), ("g1", "lh"), ("lh", "g1")]] == [
            "connected"
        ] * 4
        hosts.heal("g0", "g1")
        assert _connect(hosts, "g0", "g1") == "connected" and _connect(hosts, "g1", "g0") == "connected"


@pytest.mark.slow
@needs_netns
def test_a_shaped_host_link_can_be_reshaped_and_unshaped():
    with NetnsHosts(["g0", "g1"], {"g0": 2.0}) as hosts:
        qdisc = ["ip", "netns", "exec", hosts.namespace("g0"), "tc", "qdisc", "show", "dev", netns_link.LINK_IF]
        assert "rate 2Mbit" in subprocess.run(qdisc, check=True, capture_output=True, text=True).stdout
        hosts.shape("g0", 8.0)
        assert "rate 8Mbit" in subprocess.run(qdisc, check=True, capture_output=True, text=True).stdout
        hosts.shape("g0", 0)
        assert "tbf" not in subprocess.run(qdisc, check=True, capture_output=True, text=True).stdout
        hosts.shape("g1", 0)  # never shaped: nothing to remove
