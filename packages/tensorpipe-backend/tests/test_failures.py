"""A peer killed mid-call, and a graceful shutdown while calls are in flight (all in spawned workers)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from tpb_workers import (
    CONTEXT,
    call_then_shut_down,
    free_port,
    graceful_scenario_caller,
    kill_scenario_caller,
    options,
    serve,
    serve_late,
    serve_until,
    serve_until_liveness,
    shut_down_beside_a_stopped_peer,
    spawned,
)

import rpc_registry.rendezvous
from rpc_registry import init_rpc, rpc_sync, shutdown
from tensorpipe_backend import ensure_registered

pytestmark = pytest.mark.timeout(60)


def test_killed_peer_fails_its_pending_calls_within_five_seconds_naming_it() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    sent, results = CONTEXT.Queue(), CONTEXT.Queue()
    # Separate events: killing a process that waits on an event breaks that event for the others.
    killed, release_k1, never = CONTEXT.Event(), CONTEXT.Event(), CONTEXT.Event()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (kill_scenario_caller, (init_method, sent, killed, results, release_k1)),
        (serve_until, ("k1", 1, 3, init_method, release_k1)),
        (serve_until, ("k2", 2, 3, init_method, never)),
    ]
    with spawned(targets) as workers:
        assert sent.get(timeout=40) == "sent"
        workers[2].kill()
        killed.set()
        errors, elapsed, survivor, neg = results.get(timeout=30)
    assert len(errors) == 4 and all(e.startswith("ConnectionError: worker k2") for e in errors), errors
    assert elapsed < 5.0
    assert survivor == 1 and neg == [-1.0, -1.0]
    assert [w.exitcode for w in workers[:2]] == [0, 0]


def test_graceful_shutdown_loses_no_call_in_flight() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (graceful_scenario_caller, (init_method, results)),
        (call_then_shut_down, ("g1", 1, 3, init_method, results)),
        (serve, ("g2", 2, 3, init_method)),
    ]
    with spawned(targets) as workers:
        reports = dict(results.get(timeout=40) for _ in range(2))
    assert reports == {"g0": 7, "g1": [0, 1, 2, 3, 10]}
    assert [w.exitcode for w in workers] == [0, 0, 0]


def test_non_graceful_shutdown_is_local_and_fast() -> None:
    init_rpc("alone", ensure_registered(), 0, 1, options(f"tcp://127.0.0.1:{free_port()}"))
    start = time.monotonic()
    shutdown(graceful=False)
    assert time.monotonic() - start < 2.0


def test_a_shutdown_beside_a_stopped_peer_that_reads_nothing_ends_in_bounded_time() -> None:
    # No liveness watch to cut the connection: the goodbye to s1 waited for its full socket (or
    # for the send lock of the call stuck on it) without limit.
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, stopped, never = CONTEXT.Queue(), CONTEXT.Event(), CONTEXT.Event()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (shut_down_beside_a_stopped_peer, (init_method, results, stopped)),
        (serve_until_liveness, ("s1", 1, 2, init_method, never, 0.0)),
    ]
    with spawned(targets, timeout=20) as workers:
        try:
            assert results.get(timeout=40) == "ready"
            peer = workers[1].pid
            assert peer is not None
            os.kill(peer, signal.SIGSTOP)
            stopped.set()
            outcome, seconds, warnings = results.get(timeout=40)
        finally:
            workers[1].kill()
    assert (
        outcome == "no error" and seconds < 5.0 + 3.0
    )  # the goodbyes' 5 s, then the close, (outcome, seconds)
    assert any("s1 read nothing for 5.0 s; this worker leaves without telling them" in w for w in warnings), (
        warnings
    )
    assert workers[0].exitcode == 0


def test_a_graceful_shutdown_beside_a_stopped_peer_ends_within_its_timeout() -> None:
    # Its calls to s1 never end: the shutdown fails at its timeout, and its goodbyes then waited
    # 5 s more.
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, stopped, never = CONTEXT.Queue(), CONTEXT.Event(), CONTEXT.Event()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (shut_down_beside_a_stopped_peer, (init_method, results, stopped, 2.0)),
        (serve_until_liveness, ("s1", 1, 2, init_method, never, 0.0)),
    ]
    with spawned(targets, timeout=20) as workers:
        try:
            assert results.get(timeout=40) == "ready"
            peer = workers[1].pid
            assert peer is not None
            os.kill(peer, signal.SIGSTOP)
            stopped.set()
            outcome, seconds, _ = results.get(timeout=40)
        finally:
            workers[1].kill()
    # Within its timeout and a margin for a loaded host, well short of the 5 s goodbyes.
    assert outcome.startswith("TimeoutError") and seconds < 2.0 + 2.5, (outcome, seconds)


def test_init_rpc_names_the_missing_worker_within_its_rendezvous_timeout_plus_a_second() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 1 never arrived.*rendezvous_timeout \(now 3 s\)"):
        init_rpc(
            "w0", ensure_registered(), 0, 2, options(init_method, rpc_timeout=0.5, rendezvous_timeout=3.0)
        )
    assert 3.0 <= time.monotonic() - start < 4.0


def test_a_late_worker_is_waited_for_beyond_rpc_timeout_and_named_meanwhile(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As torch's init_rpc: rpc_timeout limits calls, not the wait for the group."""
    monkeypatch.setattr(rpc_registry.rendezvous, "PROGRESS_S", 1.0)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with spawned([(serve_late, ("late", 1, 2, init_method, 3.0, 0.5))]) as workers:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rpc_registry.rendezvous"):
            init_rpc("w0", ensure_registered(), 0, 2, options(init_method, rpc_timeout=0.5))
        waited = time.monotonic() - start
        try:
            assert rpc_sync("late", sum, args=([1, 2],)) == 3
        finally:
            shutdown(graceful=True, timeout=30.0)
    assert waited >= 2.0, f"init_rpc returned after {waited:.1f} s, before the late worker started"
    notes = [r.getMessage() for r in caplog.records if "waiting for rank 1" in r.getMessage()]
    assert notes, "no warning named the rank being waited for"
    assert [w.exitcode for w in workers] == [0]
