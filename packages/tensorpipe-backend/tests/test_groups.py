"""Groups: a static group shuts down right after init; in a dynamic group workers join and leave.

In the dynamic group every member keeps correct reverse device maps.

Device maps name CUDA devices; torch is made to report two of them in every
worker (no tensor goes to a GPU here), so that the maps validate on any
machine and the reverse maps each worker computes can be checked. torch's
own dynamic join hands every member the joiner's reverse maps instead.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tpb_workers import (
    CONTEXT,
    call_at_once,
    dial_while_shutting_down,
    dynamic_leader,
    dynamic_member,
    free_port,
    init_reporting_error,
    init_then_shut_down,
    join_call_then_leave,
    join_holding_the_membership_token_forever,
    join_then_leave_when_told,
    look_up_a_record_removed_meanwhile,
    options,
    serve_until,
    spawned,
    whoami,
)

from rpc_registry import get_worker_info, init_rpc, rpc_sync, shutdown
from tensorpipe_backend import ensure_registered

pytestmark = pytest.mark.timeout(60)

MAPS: dict[str, dict[str, dict[int, int]]] = {
    "d0": {"d1": {0: 1}, "d2": {1: 1}},
    "d1": {"d0": {1: 0}, "d2": {0: 1}},
    "d2": {"d0": {0: 0}, "d1": {1: 0}},
}


def expected_reverse(me: str) -> dict[str, dict[str, str]]:
    """Each peer's map to ``me``, inverted: what ``me`` needs to reply to it."""
    return {
        peer: {f"cuda:{dst}": f"cuda:{src}" for src, dst in maps[me].items()}
        for peer, maps in MAPS.items()
        if peer != me and me in maps
    }


def test_members_join_and_leave_with_correct_reverse_maps() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    leave = [CONTEXT.Event(), CONTEXT.Event()]
    joined = [CONTEXT.Event(), CONTEXT.Event()]
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (dynamic_leader, (init_method, MAPS["d0"], results, leave, joined)),
        *(
            (dynamic_member, (f"d{r}", r, init_method, MAPS[f"d{r}"], leave[r - 1], joined[r - 1]))
            for r in (1, 2)
        ),
    ]
    with spawned(targets, timeout=40) as workers:
        report = results.get(timeout=50)
    assert report["joined"] == ["d0", "d1", "d2"]
    assert report["reverse"] == {name: expected_reverse(name) for name in ("d0", "d1", "d2")}
    assert report["after_leave"] == ["d0", "d2"]
    assert "d1" in report["call_to_left"] and report["call_to_left"] != "no error"
    assert report["d2_still_serves"] == "d2" and report["d2_forgot_d1"] is True
    assert [w.exitcode for w in workers] == [0, 0, 0]


def test_a_name_two_workers_take_is_refused_with_torchs_runtime_error() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    with spawned([(init_reporting_error, ("dup", 1, 2, init_method, results))]) as workers:
        match = r"name='dup' is not unique: the workers of ranks \[0, 1\] have it"
        with pytest.raises(RuntimeError, match=match) as raised:
            init_rpc("dup", ensure_registered(), 0, 2, options(init_method))
        assert isinstance(raised.value, ValueError)  # this package's type before, still caught
        assert re.search(match, results.get(timeout=30))
    assert [w.exitcode for w in workers] == [0]


def test_first_dynamic_member_alone_can_call_itself() -> None:
    init_rpc("solo", ensure_registered(), 0, None, options(f"tcp://127.0.0.1:{free_port()}"))
    try:
        assert get_worker_info().name == "solo"
        assert rpc_sync("solo", whoami) == "solo"
    finally:
        shutdown(graceful=True, timeout=10.0)


def test_a_joiner_killed_holding_the_membership_token_blocks_neither_joins_nor_leaves() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    holding, go, results = CONTEXT.Event(), CONTEXT.Event(), CONTEXT.Queue()
    with spawned([(join_then_leave_when_told, ("d0", 0, init_method, results, go))]):
        assert results.get(timeout=30) == ("joined", "d0")
        with spawned([(join_holding_the_membership_token_forever, ("j", 1, init_method, holding))]) as (
            joiner,
        ):
            assert holding.wait(30) and joiner.pid is not None
            os.kill(joiner.pid, signal.SIGKILL)
            joiner.join(10)
        with spawned([(init_then_shut_down, ("k", 2, None, init_method, results))]):
            assert results.get(timeout=30)[0] == "k"  # joined, then left within 10 s
        go.set()  # d0 leaves, with no time limit
        assert results.get(timeout=30) == ("left", "d0", ["d0"])


def test_a_worker_taking_a_departed_workers_rank_or_coming_back_joins_the_same_group() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    go, results = CONTEXT.Event(), CONTEXT.Queue()
    with spawned([(join_then_leave_when_told, ("d0", 0, init_method, results, go))]):
        assert results.get(timeout=30) == ("joined", "d0")
        # One process joins, leaves and joins again; then a new one takes its rank and name.
        for times in (2, 1):
            with spawned([(join_call_then_leave, ("w", 1, init_method, "d0", results, times))]):
                for _ in range(times):
                    assert results.get(timeout=30) == (["d0", "w"], "no error")
        go.set()
        assert results.get(timeout=30) == ("left", "d0", ["d0"])


def test_a_connection_dialled_while_the_worker_shuts_down_is_closed_and_its_call_fails() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, done = CONTEXT.Queue(), CONTEXT.Event()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (serve_until, ("w0", 0, 3, init_method, done)),
        (dial_while_shutting_down, ("w1", 1, 3, init_method, results, done)),
        (serve_until, ("w2", 2, 3, init_method, done)),
    ]
    with spawned(targets):
        outcome, connections, readers = results.get(timeout=30)
    assert re.match(r"RuntimeError: w1: the agent is shut down", outcome), outcome
    assert (connections, readers) == ([], [])


def test_a_worker_takes_the_name_of_a_member_whose_process_ended_without_anyone_seeing(
    tmp_path: Path,
) -> None:
    # A store of its own (a file), which outlives every worker: nobody saw the first "w" end.
    init_method = f"file://{tmp_path / 'store'}"
    # A queue for each: one a process was killed using may stay locked.
    go, joined, results = CONTEXT.Event(), CONTEXT.Queue(), CONTEXT.Queue()
    with spawned([(join_then_leave_when_told, ("w", 1, init_method, joined, go))]) as (first,):
        assert joined.get(timeout=30) == ("joined", "w")
        assert first.pid is not None
        os.kill(first.pid, signal.SIGKILL)
        first.join(10)
    with spawned([(join_call_then_leave, ("w", 1, init_method, "w", results))]):
        assert results.get(timeout=30) == (["w"], "no error")


def test_a_worker_without_world_size_cannot_join_a_static_group_with_torchs_error() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results, done = CONTEXT.Queue(), CONTEXT.Event()
    with spawned([(serve_until, ("w1", 1, 2, init_method, done))]):
        init_rpc("w0", ensure_registered(), 0, 2, options(init_method))
        try:
            with spawned([(init_reporting_error, ("w2", 2, None, init_method, results))]):
                error = results.get(timeout=30)
        finally:
            done.set()
            shutdown(graceful=False)
    assert error.startswith(
        "RuntimeError: RPC group mixes statically and dynamically initialized members which is not supported"
    ), error


def test_shutdown_right_after_init_does_not_time_out() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    targets = [(init_then_shut_down, (f"s{r}", r, 3, init_method, results)) for r in range(3)]
    with spawned(targets) as workers:
        reports = dict(results.get(timeout=40) for _ in range(3))
    assert sorted(reports) == ["s0", "s1", "s2"]
    # Well within the 20 s rpc_timeout and the 10 s shutdown timeout the workers use.
    assert max(reports.values()) < 5.0, reports
    assert [w.exitcode for w in workers] == [0, 0, 0]


def test_called_functions_can_use_rpc_right_after_init() -> None:
    # Requests may reach a worker before its init_rpc has returned; they must find RPC ready.
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    targets = [(call_at_once, (f"a{r}", r, 3, init_method, results)) for r in range(3)]
    with spawned(targets) as workers:
        reports = dict(results.get(timeout=40) for _ in range(3))
    assert reports == {"a0": "a2", "a1": "a0", "a2": "a1"}
    assert [w.exitcode for w in workers] == [0, 0, 0]


def test_a_record_taken_out_of_the_store_while_looked_up_never_stalls_the_lookup() -> None:
    """A peer may delete a worker's record (it left, or was judged lost) between two reads of
    the store: the lookup ends at once, found or not, instead of waiting out the store's timeout."""
    results = CONTEXT.Queue()
    target = (look_up_a_record_removed_meanwhile, (f"tcp://127.0.0.1:{free_port()}", results))
    with spawned([target], timeout=50):
        outcome, seconds = results.get(timeout=50)
    assert seconds < 2.0, (outcome, seconds)
    assert outcome == "no error" or "could not find destination" in outcome, outcome
