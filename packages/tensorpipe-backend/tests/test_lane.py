"""Workers that share no host identity (as on two hosts): a TCP connection and its lane, which
carries half of each large tensor."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
from tpb_workers import (
    TOKEN,
    free_port,
    lanes,
    options,
    peer_transports,
    serve_as_another_host,
    spawned,
)

from rpc_registry import init_rpc, rpc_sync, shutdown
from tensorpipe_backend import ensure_registered, get_current_agent
from tensorpipe_backend.auth import AuthenticationError, HandshakeStatus, PeerIdentity, client_handshake
from tensorpipe_backend.lane import LANE_MIN_BYTES, lane_rank

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
    assert get_current_agent().peer_transports == {"w1": "tcp"}
    assert lanes() == {"w1": True}
    assert rpc_sync("w1", lanes) == {"w0": True}
    assert rpc_sync("w1", peer_transports) == {"w0": "tcp"}


def test_tensors_below_the_lane_size_and_mixed_messages_arrive_intact() -> None:
    small, large = torch.arange(1000.0), torch.randn(3 * LANE_MIN_BYTES // 8)
    total = rpc_sync("w1", torch.cat, args=([large, small, large.double().float()],))
    assert torch.equal(total, torch.cat([large, small, large]))
    for _ in range(3):
        assert torch.equal(rpc_sync("w1", torch.clone, args=(large,)), large)


def test_a_second_lane_or_a_lane_for_another_rank_is_refused() -> None:
    big = torch.randn(LANE_MIN_BYTES // 4)
    assert torch.equal(rpc_sync("w1", torch.neg, args=(big,)), -big)  # connected, with a lane
    me = get_current_agent().address
    with socket.create_connection(me, timeout=5) as sock:
        lane = PeerIdentity("w1", lane_rank(1))
        _, status = client_handshake(sock, TOKEN.encode(), lane, PeerIdentity("w0", 0))
        assert status is HandshakeStatus.DUPLICATE
    with socket.create_connection(me, timeout=5) as sock, pytest.raises(AuthenticationError):
        client_handshake(sock, TOKEN.encode(), PeerIdentity("w1", lane_rank(0)), PeerIdentity("w0", 0))
    assert torch.equal(rpc_sync("w1", torch.neg, args=(big,)), -big)
    assert lanes() == {"w1": True}
