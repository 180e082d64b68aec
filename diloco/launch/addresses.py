"""Every address a role will bind or dial, checked before any process starts or any file is written.

A host name that does not resolve, an address that is not this machine's, or a lighthouse port
already taken would otherwise surface as a socket traceback from deep inside the launcher (its
free-port probe) or the lighthouse, after the run directory was claimed. Here each becomes one
line naming the key, the value and the fix (``ConfigError``).

The job's sockets are IPv4 (the lighthouse's HTTP server, the launcher's port probe), so an
address must be an IPv4 one or a name that resolves to one.
"""

from __future__ import annotations

import socket
import time

from diloco.config.base import ConfigError
from diloco.config.cluster import LighthouseConfig
from diloco.config.job import JobConfig

LISTEN_RETRY_S = 0.5  # between connects to a lighthouse that may still be starting
BIND_HINT = "use 127.0.0.1 for a job on this machine, or an address of one of this machine's interfaces"


def check_addresses(job: JobConfig) -> None:
    """Raise ``ConfigError`` if ``job.role`` could not bind or reach an address its config names.

    ``local`` binds ``cluster.lighthouse.host`` and ``cluster.master_addr`` here; ``lighthouse``
    binds ``cluster.lighthouse.host``; ``group`` dials ``cluster.lighthouse.host`` at a fixed
    ``cluster.lighthouse.port`` (0 would pick a free one, which no lighthouse listens on). A fixed
    ``cluster.lighthouse.port`` must be free where the lighthouse will listen. Other roles open
    no socket.
    """
    lighthouse = job.cluster.lighthouse
    if job.role == "local":
        check_bindable("cluster.lighthouse.host", lighthouse.host)
        check_bindable("cluster.master_addr", job.cluster.master_addr)
    elif job.role == "lighthouse":
        check_bindable("cluster.lighthouse.host", lighthouse.host)
    elif job.role == "group":
        resolve("cluster.lighthouse.host", lighthouse.host)
        if not lighthouse.port:
            raise ConfigError(
                "cluster.lighthouse.port=0: role=group dials the job's lighthouse, so set it to the port "
                "role=lighthouse listens on (its fixed cluster.lighthouse.port)"
            )
    if job.role in ("local", "lighthouse") and lighthouse.port:
        check_port_free(lighthouse.host, lighthouse.port)


def resolve(key: str, host: str) -> str:
    """The IPv4 address ``host`` names; ``ConfigError`` naming ``key`` if it names none."""
    if not host:
        raise ConfigError(f"{key}='': must be a host name or an IPv4 address, e.g. 127.0.0.1")
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as error:
        if _is_ipv6(host):
            raise ConfigError(
                f"{key}={host}: an IPv6 address; the job's sockets are IPv4, so use an IPv4 address "
                "(127.0.0.1 on this machine) or a host name with an IPv4 address"
            ) from None
        reason = error.strerror if isinstance(error, socket.gaierror) else str(error)
        raise ConfigError(
            f"{key}={host}: does not resolve to an IPv4 address ({reason}); check the spelling, or use an IP address"
        ) from None


def check_bindable(key: str, host: str) -> None:
    """``ConfigError`` naming ``key`` unless ``host`` resolves to an address this machine can listen on."""
    address = resolve(key, host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError as error:
            shown = host if address == host else f"{host} ({address})"
            raise ConfigError(
                f"{key}={shown}: cannot listen there ({error.strerror or error}): not an address of this machine; "
                f"{BIND_HINT}"
            ) from None


def check_port_free(host: str, port: int) -> None:
    """``ConfigError`` naming ``cluster.lighthouse.port`` if another process listens on it at ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the lighthouse's HTTP server binds
        try:
            sock.bind((resolve("cluster.lighthouse.host", host), port))
        except OSError as error:
            raise ConfigError(
                f"cluster.lighthouse.port={port}: cannot listen on {host}:{port} ({error.strerror or error}); "
                "stop what listens there (another lighthouse?) or pick another cluster.lighthouse.port "
                "(0 picks a free one)"
            ) from None


def check_lighthouse_listens(lighthouse: LighthouseConfig, within_s: float) -> None:
    """``ConfigError`` unless the lighthouse accepts a connection within ``within_s`` (one try every
    half second): checked before a group builds its model, so a wrong address costs one wait, not
    a model built and a wait on every restart."""
    address = (resolve("cluster.lighthouse.host", lighthouse.host), lighthouse.port)
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection(address, timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"cannot reach the lighthouse at {lighthouse.host}:{lighthouse.port} within "
                    f"cluster.timeouts.connect={within_s:g}s ({error.strerror or error}), and this group was never "
                    "part of this job: check cluster.lighthouse.host and cluster.lighthouse.port, and that "
                    "role=lighthouse runs there"
                ) from None
        time.sleep(LISTEN_RETRY_S)


def _is_ipv6(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6, host.strip("[]"))
    except (OSError, ValueError):
        return False
    return True
