"""Bytes from a stranger on a worker's ports (and on the rendezvous store's) never disturb the calls
of authenticated peers."""

from __future__ import annotations

from typing import Any

import pytest
from tpb_workers import (
    CONTEXT,
    call_a_busy_peer,
    call_once_ready,
    free_port,
    garbage_then_call,
    serve_busy_until_asked,
    serve_meeting_a_flood_in_the_first_handshake,
    serve_until,
    serve_until_liveness,
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
        (serve_meeting_a_flood_in_the_first_handshake, (init_method, ready, done, results, tcp)),
        (serve_until, ("w0", 0, 3, init_method, done)),
    ]
    with spawned(targets) as workers:
        reports = dict(results.get(timeout=90) for _ in range(2))
    assert reports["w2"] == "no error"
    cut_after = reports["w1"]
    assert len(cut_after) == 1 and cut_after[0] < 2.0, f"the flood cut the member's handshake: {cut_after}"
    assert [w.exitcode for w in workers] == [0, 0, 0]


@pytest.mark.parametrize("before_proof", [False, True], ids=["after-the-proof", "before-the-proof"])
def test_a_peer_that_cuts_every_handshake_fails_the_call_in_time_and_is_not_judged_lost(
    before_proof: bool,
) -> None:
    """Under a flood that never ends (w1 cuts every handshake), a call fails within its dial's limit
    (the liveness timeout, 2 s), naming the cause; w1 answered, so it is not judged lost: the next
    call, once the flood is over, goes through. Busy answers that came before the proof (which a
    stranger could have recorded and replay) are taken only a few times in a row."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, ready, calm, done = CONTEXT.Queue(), CONTEXT.Event(), CONTEXT.Event(), CONTEXT.Event()
    targets: list[tuple[Any, tuple[Any, ...]]] = [
        (call_a_busy_peer, (init_method, ready, calm, done, results)),
        (serve_busy_until_asked, (init_method, ready, calm, done, before_proof)),
        (serve_until_liveness, ("w0", 0, 3, init_method, done, 2.0)),
    ]
    with spawned(targets) as workers:
        first, seconds, second = results.get(timeout=90)
    assert first.startswith("ConnectionError: worker w1 (rank 1) cut ")
    assert "handshakes with w2 in a row" in first and "not judged lost" in first
    if before_proof:
        assert "cut 4 handshakes" in first and seconds < 1.5
    else:
        assert 1.7 < seconds < 2.6
    assert second == "no error"
    assert [w.exitcode for w in workers] == [0, 0, 0]
