"""The address a worker publishes: reachable by its peers, or a failure that says how to fix it."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import pytest

from tensorpipe_backend.address import ADDR_ENV, check_reachable, listen_host


def _has_default_route() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
        except OSError:
            return False
    return True


@pytest.fixture
def debian_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    """``node0`` resolves to 127.0.1.1 here, as Debian's /etc/hosts maps the host name."""
    real = socket.getaddrinfo

    def fake(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "node0":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    monkeypatch.delenv(ADDR_ENV, raising=False)


@pytest.mark.skipif(not _has_default_route(), reason="this host has no default route")
@pytest.mark.usefixtures("debian_hostname")
def test_the_store_host_named_by_a_loopback_alias_publishes_its_outward_address() -> None:
    host = listen_host("tcp://node0:29500")
    assert not host.startswith("127."), host
    socket.create_server((host, 0)).close()  # an address of this host


def test_a_loopback_rendezvous_keeps_the_loopback_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADDR_ENV, raising=False)
    assert listen_host("tcp://127.0.0.1:29500") == "127.0.0.1"
    assert listen_host("tcp://localhost:29500") == "127.0.0.1"


def test_the_environment_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADDR_ENV, "10.1.2.3")
    assert listen_host("tcp://127.0.0.1:29500") == "10.1.2.3"


@dataclass(frozen=True)
class _Record:
    name: str
    host: str
    shm_host: str


def test_a_loopback_address_with_a_peer_on_another_host_fails_naming_the_variable() -> None:
    with pytest.raises(RuntimeError, match=f"worker w0 listens on 127.0.0.1.*{ADDR_ENV}"):
        check_reachable([_Record("w0", "127.0.0.1", "hostA"), _Record("w1", "10.0.0.2", "hostB")])
    check_reachable([_Record("w0", "127.0.0.1", "hostA"), _Record("w1", "127.0.0.1", "hostA")])
