"""experiments/communication/netns_link.py: the tbf command line and subnet choice (fast), and a real shaped link
between two namespaces, whose transfers run at its rate (slow; needs root, ``ip`` and ``tc``)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from experiments.communication import netns_link
from experiments.communication.netns_link import NetnsLink, pick_subnet, tbf_args

# A receiver in one namespace: listens, reads ``n`` bytes, answers one byte, prints when the first came.
RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
got = 0
while got < int(sys.argv[2]):
    chunk = conn.recv(1 << 16)
    assert chunk, got
    got += len(chunk)
conn.sendall(b"k")
"""
SENDER = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
started = time.monotonic()
conn.sendall(bytes(int(sys.argv[3])))
conn.recv(1)
print(time.monotonic() - started)
"""


def test_tbf_args_from_a_rate():
    assert tbf_args(1.0) == ["tbf", "rate", "1000000bit", "burst", "6250", "latency", "100ms"]
    assert tbf_args(0.25)[4] == str(netns_link.MIN_BURST_BYTES), "never a bucket smaller than two frames"
    assert tbf_args(100.0)[2:5] == ["100000000bit", "burst", "625000"]
    with pytest.raises(ValueError, match="unlimited"):
        tbf_args(0.0)


def test_pick_subnet_skips_taken_networks():
    first = pick_subnet([], 0)
    assert str(first) == "10.128.0.0/24"
    assert str(pick_subnet(["default", "10.128.0.0/23", "172.17.0.0/16"], 0)) == "10.128.2.0/24"
    assert pick_subnet([], 5) != first, "runs with other tags start elsewhere"
    with pytest.raises(netns_link.NetnsError):
        pick_subnet(["10.0.0.0/8"], 0)


def test_prefix_runs_the_worker_in_its_namespace_with_gloo_on_the_veth():
    link = NetnsLink(2, 1.0)
    assert link.prefix(1)[:4] == ["ip", "netns", "exec", link.namespaces[1]]
    assert link.prefix(1)[-1] == f"GLOO_SOCKET_IFNAME={netns_link.LINK_IF}"
    assert len(link.root_if) <= 15 and all(len(n) < 64 for n in link.namespaces)


def _netns_python(namespace: str, code: str, *args: str) -> subprocess.Popen:
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-c", code, *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.skipif(netns_link.unavailable() is not None, reason=f"shaped link: {netns_link.unavailable()}")
def test_transfer_between_namespaces_runs_at_the_tbf_rate():
    """4 Mbit/s: 1.5 MB takes 3 s; TCP/IP and Ethernet headers cost ~4% of it, so the goodput
    lies within [0.85, 1.02] of the rate. Afterwards nothing of the link is left."""
    mbps, nbytes = 4.0, 1_500_000
    with NetnsLink(2, mbps) as link:
        receiver = _netns_python(link.namespaces[1], RECEIVER, link.address(1), str(nbytes))
        port = receiver.stdout.readline().strip()
        sender = _netns_python(link.namespaces[0], SENDER, link.address(1), port, str(nbytes))
        out, err = sender.communicate(timeout=20)
        assert sender.returncode == 0, err
        receiver.communicate(timeout=5)
        seconds = float(out)
        names = set(subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout.split())
        assert set(link.namespaces) | {link.hub} <= names
    goodput_mbps = nbytes * 8 / seconds / 1e6
    assert 0.85 * mbps <= goodput_mbps <= 1.02 * mbps, f"{goodput_mbps:.3f} Mbit/s over a {mbps} Mbit/s tbf"
    time.sleep(0.2)
    left = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    assert not set(left.split()) & (set(link.namespaces) | {link.hub}), left
    links = subprocess.run(["ip", "link", "show"], check=True, capture_output=True, text=True).stdout
    assert link.root_if not in links
