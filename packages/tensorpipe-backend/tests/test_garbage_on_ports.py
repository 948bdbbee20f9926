"""Bytes from a stranger on a worker's ports (and on the rendezvous store's) never disturb the calls
of authenticated peers."""

from __future__ import annotations

from typing import Any

import pytest
from tpb_workers import CONTEXT, free_port, garbage_then_call, serve_until, spawned

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
