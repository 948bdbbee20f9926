"""Requests that wait in a peer's strand (they arrived before the handler was set) still run
when an earlier request of that peer waits for one of them."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pytest
from tpb_workers import (
    CONTEXT,
    call_back_through,
    call_s1_scenario,
    free_port,
    release,
    serve_once_queued,
    spawned,
    wait_for_release,
)

pytestmark = pytest.mark.timeout(120)


def _first_outcome(calls: list[tuple[Callable[..., object], tuple[Any, ...]]]) -> object:
    """What the first of ``calls`` returned (or its error's text) when s0 sent them all to s1
    before s1 started handling requests, so that they waited in s1's strand of s0."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, done = CONTEXT.Queue(), CONTEXT.Event()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (call_s1_scenario, (init_method, results, done, calls)),
        (serve_once_queued, ("s1", 1, 2, init_method, len(calls), done)),
    ]
    with spawned(targets, timeout=60.0) as workers:
        try:
            outcome: object = results.get(timeout=90)
        except queue.Empty:
            pytest.fail("s0 reported nothing within 90 s")
        finally:
            done.set()
    assert [w.exitcode for w in workers] == [0, 0]
    return outcome


def test_a_queued_request_that_calls_out_lets_the_later_requests_of_its_peer_run() -> None:
    """The request, run from s1's strand, calls s0, which calls s1 back: without a hand-off that
    call back waits behind the request until it times out (3 s)."""
    outcome = _first_outcome([(call_back_through, ("s0", 3.0))])
    assert isinstance(outcome, tuple), f"the request failed: the call back to s1 was not served ({outcome})"
    thread, answer = outcome
    assert thread.startswith("tpb-s1_"), f"the request ran on {thread}, not on a runner of its strand"
    assert answer == "s1"


def test_a_queued_request_that_blocks_lets_the_later_requests_of_its_peer_run() -> None:
    """The first request waits (3 s at most, without calling out) for the second one, queued
    behind it in s1's strand: the watch hands the strand on."""
    outcome = _first_outcome([(wait_for_release, (3.0,)), (release, ())])
    assert isinstance(outcome, tuple), f"the request failed: {outcome}"
    thread, released = outcome
    assert thread.startswith("tpb-s1_"), f"the request ran on {thread}, not on a runner of its strand"
    assert released, "the later request did not run while the first one waited for it"
