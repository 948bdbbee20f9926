"""Workers that share no host identity (as on two hosts): a TCP connection and its lane, which
carries half of each large tensor."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tpb_workers import (
    TOKEN,
    address,
    free_port,
    lanes,
    local_port,
    options,
    peer_transports,
    serve_as_another_host,
    spawned,
    wait_for_lanes,
)

from rpc_registry import WorkerInfo, init_rpc, rpc_sync, shutdown
from tensorpipe_backend import connection, ensure_registered, get_current_agent, wire
from tensorpipe_backend.auth import AuthenticationError, HandshakeStatus, PeerIdentity, client_handshake
from tensorpipe_backend.connection import Connection, prepare_tensor
from tensorpipe_backend.lane import LANE_MIN_BYTES, lane_rank
from tensorpipe_backend.wire import Kind

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    targets = [(serve_as_another_host, ("w1", 1, 2, init_method))]
    with spawned(targets) as workers, pytest.MonkeyPatch.context() as patch:
        patch.setattr("tensorpipe_backend.agent.host_identity", lambda: "")
        init_rpc("w0", ensure_registered(), 0, 2, options(init_method))
        try:
            yield
        finally:
            shutdown(graceful=True, timeout=30.0)
    assert [w.exitcode for w in workers] == [0]


def test_large_tensors_cross_on_the_connection_and_its_lane() -> None:
    big = torch.randn(LANE_MIN_BYTES // 4 + 12345)  # not a whole number of pages either
    assert torch.equal(rpc_sync("w1", torch.neg, args=(big,)), -big)
    assert wait_for_lanes({"w1": True}) == {"w1": True}
    assert rpc_sync("w1", wait_for_lanes, args=({"w0": True},)) == {"w0": True}
    for _ in range(3):  # both ways on the lane now
        assert torch.equal(rpc_sync("w1", torch.neg, args=(big,)), -big)
    assert get_current_agent().peer_transports == {"w1": "tcp"}
    assert rpc_sync("w1", peer_transports) == {"w0": "tcp"}


def test_tensors_below_the_lane_size_and_mixed_messages_arrive_intact() -> None:
    small, large = torch.arange(1000.0), torch.randn(3 * LANE_MIN_BYTES // 8)
    total = rpc_sync("w1", torch.cat, args=([large, small, large.double().float()],))
    assert torch.equal(total, torch.cat([large, small, large]))
    for _ in range(3):
        assert torch.equal(rpc_sync("w1", torch.clone, args=(large,)), large)


def test_a_second_lane_a_lane_of_another_connection_or_rank_is_refused() -> None:
    big = torch.randn(LANE_MIN_BYTES // 4)
    assert torch.equal(rpc_sync("w1", torch.neg, args=(big,)), -big)
    assert wait_for_lanes({"w1": True}) == {"w1": True}
    w1 = PeerIdentity("w1", 1)
    where = ("127.0.0.1", rpc_sync("w1", address)[1])
    # The lane of this connection (whichever end dialled it) is taken; one of another is refused.
    for port in (local_port("w1"), 1):
        with socket.create_connection(where, timeout=5) as sock:
            lane = PeerIdentity("w0", lane_rank(0, port))
            assert client_handshake(sock, TOKEN.encode(), lane, w1)[1] is HandshakeStatus.DUPLICATE
    with socket.create_connection(where, timeout=5) as sock, pytest.raises(AuthenticationError):
        client_handshake(sock, TOKEN.encode(), PeerIdentity("w0", lane_rank(1, local_port("w1"))), w1)
    assert torch.equal(rpc_sync("w1", torch.neg, args=(big,)), -big)
    assert rpc_sync("w1", lanes) == {"w0": True}


@pytest.fixture
def pair() -> Iterator[tuple[Connection, Connection]]:
    """Two ends of a connection (socket pairs) with their lanes attached; closed afterwards."""
    main, lane = socket.socketpair(), socket.socketpair()
    ends = Connection(WorkerInfo("b", 1), main[0]), Connection(WorkerInfo("a", 0), main[1])
    for end, sock in zip(ends, lane):
        assert end.lane.claim()
        end.lane.attach(sock)
    yield ends
    for end in ends:
        end.outbox.close()
    for sock in (*main, *lane):
        sock.close()


def _read_tensor(end: Connection) -> torch.Tensor:
    _, descs, _ = end.stream.read_frame()
    tensors, error = end.receive_tensors(descs, 0, "a")
    assert error is None
    return tensors[0]


def _send_and_read(a: Connection, b: Connection, tensor: torch.Tensor) -> torch.Tensor:
    """``a`` sends ``tensor`` while ``b`` reads it (on another thread: the sockets fill up)."""
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(_read_tensor, b)
        a.write(Kind.REQUEST, 1, b"", [prepare_tensor(tensor, {}, "b")])
        return received.result(timeout=10)


def test_a_broken_lane_is_dropped_and_tensors_go_whole(pair: tuple[Connection, Connection]) -> None:
    a, b = pair
    big = torch.randn(LANE_MIN_BYTES // 4)
    assert torch.equal(_send_and_read(a, b, big), big)
    b.lane.close()  # b's end of the lane goes away
    assert torch.equal(_send_and_read(a, b, big), big)
    assert a.lane.sock is None  # found broken before the send, and closed


def test_a_frame_cut_short_on_its_lane_ends_the_connection_at_both_ends(
    pair: tuple[Connection, Connection], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    lane = a.lane.sock
    real = wire.send_all

    def failing(sock: socket.socket, data: bytes | memoryview) -> None:
        if sock is lane:
            raise ConnectionResetError("the lane broke")
        real(sock, data)

    monkeypatch.setattr(connection, "send_all", failing)
    big = torch.randn(LANE_MIN_BYTES // 4)
    with ThreadPoolExecutor(1) as pool:
        received = pool.submit(_read_tensor, b)
        with pytest.raises(ConnectionResetError):
            a.write(Kind.REQUEST, 1, b"", [prepare_tensor(big, {}, "b")])
        assert isinstance(received.exception(timeout=10), EOFError)  # b's reader ends the connection
    assert a.lane.closed
    assert b.sock.recv(1) == b""  # a shut the connection down
