"""Bytes from a stranger on a worker's ports (and on the rendezvous store's) never disturb the calls
of authenticated peers."""

from __future__ import annotations

from typing import Any

import pytest
from tpb_workers import (
    CONTEXT,
    call_once_ready,
    free_port,
    garbage_then_call,
    serve_meeting_a_flood_in_the_first_handshake,
    serve_until,
    spawned,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("tcp", [False, True])
def test_garbage_on_a_workers_ports_never_fails_a_call_between_members(tcp: bool) -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, done = CONTEXT.Queue(), CONTEXT.Event()
    targets: list[tuple[Any, tuple[Any, ...]]] = [
        (garbage_then_call, ("w0", 0, 2, init_method, results, done, tcp)),
        (serve_until, ("w1", 1, 2, init_method, done)),
    ]
    with spawned(targets) as workers:
        outcomes = results.get(timeout=90)
    assert [o for o in outcomes if o != "no error"] == []
    assert [w.exitcode for w in workers] == [0, 0]


@pytest.mark.parametrize("tcp", [False, True])
def test_a_members_handshake_cut_for_a_flood_of_strangers_connects_again(tcp: bool) -> None:
    """Strangers' connections from a member's own source arrive while its handshake is under way,
    as many as one source may hold: its handshake is the oldest and is cut. The member dials again
    and its call goes through; it is never told that the two hold different secrets."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, ready, done = CONTEXT.Queue(), CONTEXT.Event(), CONTEXT.Event()
    targets: list[tuple[Any, tuple[Any, ...]]] = [
        (call_once_ready, (init_method, ready, done, results, tcp)),
        (serve_meeting_a_flood_in_the_first_handshake, (init_method, ready, done, tcp)),
        (serve_until, ("w0", 0, 3, init_method, done)),
    ]
    with spawned(targets) as workers:
        outcome = results.get(timeout=90)
    assert outcome == "no error"
    assert [w.exitcode for w in workers] == [0, 0, 0]
