"""Dialling a peer: the wait for a connection stays within the call's deadline."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rpc_registry import WorkerInfo
from tensorpipe_backend.peers import Peers

pytestmark = pytest.mark.timeout(30)


def test_a_peer_that_keeps_answering_duplicate_fails_the_dial_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The peer still holds a connection this worker dropped (it has not seen it close): each dial
    # is answered "duplicate" until it does. The caller's deadline must hold meanwhile.
    lock = threading.RLock()
    unused: Any = None
    peers = Peers(
        WorkerInfo("me", 0),
        b"secret",
        lock,
        threading.Condition(lock),
        lambda name: None,
        lambda: None,
        {},
        {},
        unused,
        unused,
        lambda *args: None,
        lambda peer, why: None,
    )
    dials: list[str] = []

    def answered_duplicate(name: str, deadline: float | None) -> None:
        dials.append(name)

    monkeypatch.setattr(peers, "_dial", answered_duplicate)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="a connection to worker p, which still holds an earlier one"):
        peers.connection("p", started + 0.5)
    assert time.monotonic() - started < 5 and len(dials) > 1
