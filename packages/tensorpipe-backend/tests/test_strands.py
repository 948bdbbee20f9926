"""Requests that wait in a peer's strand (they arrived before the handler was set) still run
when an earlier request of that peer waits for one of them."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pytest
from tpb_workers import CONTEXT, call_back_scenario, free_port, serve_once_queued, spawned

pytestmark = pytest.mark.timeout(120)


def test_a_queued_request_that_calls_out_lets_the_later_requests_of_its_peer_run() -> None:
    """s0's request waits in s1's strand until s1 starts; run there, it calls s0, which calls s1
    back: without a hand-off that call back waits behind the request until it times out (3 s)."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, done = CONTEXT.Queue(), CONTEXT.Event()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (call_back_scenario, (init_method, results, done)),
        (serve_once_queued, ("s1", 1, 2, init_method, 1, done)),
    ]
    with spawned(targets, timeout=60.0) as workers:
        try:
            outcome = results.get(timeout=90)
        except queue.Empty:
            pytest.fail("s0 reported nothing within 90 s")
        finally:
            done.set()
    assert isinstance(outcome, tuple), f"the request failed: the call back to s1 was not served ({outcome})"
    thread, answer = outcome
    assert thread.startswith("tpb-s1_"), f"the request ran on {thread}, not on a runner of its strand"
    assert answer == "s1"
    assert [w.exitcode for w in workers] == [0, 0]
