"""The address a worker listens on and publishes to its peers.

In order: ``$TENSORPIPE_BACKEND_ADDR``; the loopback address when the
rendezvous host is a loopback address (every worker is on this host); else
this host's address on the route to the rendezvous host. When the rendezvous
host is this host under a name that resolves to a loopback address (Debian
maps the host name to 127.0.1.1), peers on other hosts cannot use what that
name gives here: the address on the default route is published instead. A
worker that still publishes a loopback address while a peer runs on another
host is caught when the records are exchanged (:func:`check_reachable`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Iterable
from typing import Final, Protocol
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

__all__ = ["ADDR_ENV", "check_reachable", "listen_host"]

ADDR_ENV: Final = "TENSORPIPE_BACKEND_ADDR"
"""Environment variable: the address this worker listens on and publishes to its peers."""

_LOOPBACK: Final = "127.0.0.1"
# Any address outside this host: a UDP connect to it only picks the route, nothing is sent.
_OUTSIDE: Final = "198.51.100.1"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _route_source(address: str) -> str:
    """The local address on the route to ``address`` (``OSError`` without a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        local: str = probe.getsockname()[0]
        return local


def listen_host(init_method: str) -> str:
    """The address to listen on and publish, for a worker that rendezvouses at ``init_method``."""
    explicit = os.environ.get(ADDR_ENV)
    if explicit:
        return explicit
    parsed = urlparse(init_method)
    host = parsed.hostname if parsed.scheme == "tcp" else None
    if parsed.scheme == "env":
        host = os.environ.get("MASTER_ADDR")
    if not host or _is_loopback(host):
        return _LOOPBACK
    try:
        address = str(socket.getaddrinfo(host, None, family=socket.AF_INET)[0][4][0])
    except OSError as exc:
        logger.warning("cannot resolve %s (%s); listening on %s, set %s", host, exc, _LOOPBACK, ADDR_ENV)
        return _LOOPBACK
    if not _is_loopback(address):
        with contextlib.suppress(OSError):
            return _route_source(address)
        logger.warning("no route to %s; listening on %s, set %s", address, _LOOPBACK, ADDR_ENV)
        return _LOOPBACK
    # The rendezvous host is this host, named by an address peers elsewhere cannot use.
    try:
        outward = _route_source(_OUTSIDE)
    except OSError:
        logger.warning(
            "%s resolves to %s here and this host has no default route; listening on %s, which peers on "
            "other hosts cannot reach: set %s to this host's address if they exist",
            host,
            address,
            _LOOPBACK,
            ADDR_ENV,
        )
        return _LOOPBACK
    return outward


class _Published(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def shm_host(self) -> str: ...


def check_reachable(records: Iterable[_Published]) -> None:
    """Fail when a worker publishes a loopback address while another runs on a different host.

    Hosts are told apart by the records' ``shm_host`` identity (boot id and
    ``/dev/shm``); records without one are not compared.

    Raises:
        RuntimeError: naming the worker and :data:`ADDR_ENV`.
    """
    listed = list(records)
    hosts = {r.shm_host for r in listed if r.shm_host}
    if len(hosts) < 2:
        return
    for record in listed:
        if record.shm_host and _is_loopback(record.host):
            raise RuntimeError(
                f"worker {record.name} listens on {record.host}, which workers on other hosts cannot "
                f"reach; set {ADDR_ENV} on it to an address of its host that they can reach, or give "
                "init_method a rendezvous host that resolves to such an address there"
            )
