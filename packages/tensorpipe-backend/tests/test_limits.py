"""Limits an authenticated peer or a stranger cannot push the agent past, and limits told fast.

This process is ``lim0``; ``lim1`` and ``lim2`` are spawned (a static group
of three on 127.0.0.1, with the test secret, so that a test can act as a
member). ``lim1`` and ``lim2`` never call each other before the last test:
until then a test may dial ``lim1`` as ``lim2``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from tpb_workers import TOKEN, address, ask_whoami, free_port, options, pid, serve, sleep_then, spawned

from rpc_registry import init_rpc, rpc_async, rpc_sync, shutdown
from tensorpipe_backend import ensure_registered
from tensorpipe_backend.auth import HandshakeStatus, PeerIdentity, client_handshake
from tensorpipe_backend.wire import (
    MAX_NDIM,
    MAX_PAYLOAD_BYTES,
    MAX_TENSORS,
    Kind,
    TensorDescriptor,
    encode_descriptors,
    encode_header,
)

pytestmark = pytest.mark.timeout(90)

_GIB = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    targets = [(serve, (f"lim{rank}", rank, 3, init_method)) for rank in (1, 2)]
    with spawned(targets) as workers:
        init_rpc("lim0", ensure_registered(), 0, 3, options(init_method))
        try:
            yield
        finally:
            shutdown(graceful=True, timeout=30.0)
    assert [w.exitcode for w in workers] == [0, 0]


# Functions called on other workers (spawned workers import this module by name).
def tensors(count: int) -> list[torch.Tensor]:
    """``count`` distinct one-element tensors."""
    return list(torch.arange(float(count)).unbind())


def deep_tensor(ndim: int) -> torch.Tensor:
    """A one-element tensor of ``ndim`` dimensions."""
    return torch.zeros([1] * ndim)


def count(items: list[torch.Tensor]) -> int:
    """How many tensors arrived."""
    return len(items)


# A message over a limit fails that call alone, at once, naming the limit.
@pytest.mark.parametrize(
    ("argument", "limit"),
    [
        (lambda: tensors(MAX_TENSORS + 4464), f"limit of {MAX_TENSORS}"),
        (lambda: [deep_tensor(MAX_NDIM + 1)], f"limit of {MAX_NDIM}"),
    ],
    ids=["70000-tensors", "65-dimensions"],
)
def test_a_request_over_a_limit_fails_alone_at_once(argument: object, limit: str) -> None:
    assert callable(argument)
    in_flight = rpc_async("lim1", sleep_then, args=(1.5, 7), timeout=0)
    time.sleep(0.2)
    start = time.monotonic()
    with pytest.raises(ValueError, match=limit):
        rpc_sync("lim1", count, args=(argument(),), timeout=0)
    assert time.monotonic() - start < 10
    future = rpc_async("lim1", count, args=(argument(),), timeout=0)
    with pytest.raises(ValueError, match=limit):
        future.wait()
    assert in_flight.wait() == 7
    assert rpc_sync("lim1", count, args=(tensors(3),)) == 3


@pytest.mark.parametrize(
    ("call", "limit"),
    [
        ((tensors, MAX_TENSORS + 4464), f"limit of {MAX_TENSORS}"),
        ((deep_tensor, MAX_NDIM + 1), f"limit of {MAX_NDIM}"),
    ],
    ids=["70000-tensors", "65-dimensions"],
)
def test_a_reply_over_a_limit_fails_its_call_at_once_without_a_timeout(
    call: tuple[Callable[[int], object], int], limit: str
) -> None:
    fn, arg = call
    in_flight = rpc_async("lim1", sleep_then, args=(1.5, 8), timeout=0)
    time.sleep(0.2)
    future = rpc_async("lim1", fn, args=(arg,), timeout=0)
    deadline = time.monotonic() + 20
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert future.done(), "a reply over a limit was never reported (timeout=0 waits forever)"
    with pytest.raises(RuntimeError, match=limit):
        future.wait()
    assert in_flight.wait() == 8
    with pytest.raises(RuntimeError, match=limit):
        rpc_sync("lim1", fn, args=(arg,), timeout=0)


# An authenticated member's header does not make the receiver allocate what has not arrived.
def _dial_as_lim2() -> socket.socket:
    """A connection to lim1 that passed the handshake as lim2."""
    deadline = time.monotonic() + 10
    while True:
        sock = socket.create_connection(rpc_sync("lim1", address), timeout=5)
        _, status = client_handshake(sock, TOKEN.encode(), PeerIdentity("lim2", 2), PeerIdentity("lim1", 1))
        if status is HandshakeStatus.ACCEPTED:
            return sock
        sock.close()  # the previous test's connection is still being closed
        assert time.monotonic() < deadline, "lim1 kept refusing a second connection from lim2"
        time.sleep(0.1)


def _resident_bytes(process: int) -> int:
    with open(f"/proc/{process}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{process}/status")


def _two_gib_header(kind: str) -> bytes:
    if kind == "payload":
        return encode_header(Kind.REQUEST, 1, MAX_PAYLOAD_BYTES, 0, 0)
    desc = TensorDescriptor(torch.float32, torch.device("cpu"), (2 * _GIB // 4,), 2 * _GIB)
    block = encode_descriptors([desc])
    return encode_header(Kind.REQUEST, 1, 0, 1, len(block)) + block


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
@pytest.mark.parametrize("kind", ["payload", "tensor"])
def test_a_two_gib_header_allocates_only_what_arrives(kind: str) -> None:
    lim1 = rpc_sync("lim1", pid)
    before = _resident_bytes(lim1)
    with _dial_as_lim2() as sock:
        sock.sendall(_two_gib_header(kind) + bytes(1 << 20))
        time.sleep(2.0)  # an allocation of 2 GiB up front would be resident by now
        grown = _resident_bytes(lim1) - before
    assert grown < 256 << 20, f"lim1 grew by {grown >> 20} MiB for a frame of which 1 MiB arrived"
    assert rpc_sync("lim1", sleep_then, args=(0.0, 4)) == 4


# Handshake slots cannot be held by one source.
def test_slow_half_open_handshakes_do_not_lock_out_a_member() -> None:
    host, port = rpc_sync("lim1", address)
    stalled = []
    try:
        for _ in range(100):
            stalled.append(socket.create_connection((host, port), timeout=5))
        time.sleep(0.5)  # lim1 has accepted them all
        start = time.monotonic()
        # lim2 has no connection to lim1 yet: it dials now.
        assert rpc_sync("lim2", ask_whoami, args=("lim1",), timeout=20) == "lim1"
        assert time.monotonic() - start < 5
    finally:
        for sock in stalled:
            sock.close()


# Nothing identifies a worker before its peer proved the secret.
def _abstract_sockets(process: int) -> list[bytes]:
    inodes = set()
    for fd in os.listdir(f"/proc/{process}/fd"):
        try:
            target = os.readlink(f"/proc/{process}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    names = []
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("@"):
                names.append(b"\0" + fields[7][1:].encode())
    return names


def _first_words(family: int, where: bytes | tuple[str, int]) -> bytes:
    """What a listener says to a client that says nothing (for a second)."""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(where)
        sock.settimeout(1.0)
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except TimeoutError:
            pass
    return received


@pytest.mark.skipif(not os.path.exists("/proc/net/unix"), reason="reads /proc")
def test_a_stranger_learns_no_name_or_rank_before_the_proof() -> None:
    lim1 = rpc_sync("lim1", pid)
    local = _abstract_sockets(lim1)
    assert local, "lim1 has no abstract Unix socket"
    targets: list[tuple[int, bytes | tuple[str, int]]] = [(socket.AF_UNIX, name) for name in local]
    targets.append((socket.AF_INET, rpc_sync("lim1", address)))
    for target in targets:
        said = _first_words(*target)
        assert b"lim1" not in said, f"{target}: the worker's name was sent before any proof: {said!r}"
        # magic, version and a nonce: nothing else
        assert len(said) == 4 + 1 + 32, f"{target}: {len(said)} bytes before any proof: {said!r}"
