"""A worker lost without leaving (killed, or frozen past the liveness timeout) leaves the group.

Its calls, pending or new, fail at once naming it (name and rank) as lost;
the survivors go on calling each other, list it no more, and shut down in
bounded time; in a dynamic group it leaves the member list in the store,
new workers join (even under its name), and, frozen then resumed, it is
refused. Every scenario runs in spawned workers (see tpb_workers).
"""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from tpb_workers import (
    CONTEXT,
    dynamic_host_d0,
    dynamic_joiner,
    free_port,
    frozen_host_f0,
    serve_until,
    serve_until_liveness,
    serve_until_told,
    spawned,
    static_survivor_k0,
    survivor_whose_callback_blocks,
    zombie_f2,
)

# A spawned child imports torch first: on a loaded machine that alone can take most of a minute.
pytestmark = pytest.mark.timeout(300)
_REPORT_S = 120.0
_LIVENESS_S = 3.0
Targets = list[tuple[Callable[..., None], tuple[Any, ...]]]


def _get(results: Any, workers: list[Any]) -> Any:
    """The next report, naming a worker that died instead of waiting out the timeout."""
    deadline = time.monotonic() + _REPORT_S
    while True:
        try:
            return results.get(timeout=1)
        except queue.Empty:
            dead = [w.name for w in workers if w.exitcode not in (None, 0, -signal.SIGKILL)]
            assert not dead, f"{dead} failed before reporting"
            assert time.monotonic() < deadline, f"no report within {_REPORT_S:g} s"


def _shm_files(pids: list[int]) -> list[str]:
    if not os.path.isdir("/dev/shm"):
        return []
    prefixes = tuple(f"tpb-{pid:08x}" for pid in pids)
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefixes)]


@contextmanager
def _no_leftovers(workers: list[Any]) -> Iterator[None]:
    """After the block: no worker still runs, none left a shared-memory file."""
    pids = [w.pid for w in workers]
    yield
    for worker in workers:
        worker.join(timeout=60)
    assert [w.name for w in workers if w.is_alive()] == []
    assert _shm_files(pids) == []


def _lost(name: str, rank: int) -> str:
    return f"worker {name} (rank {rank}) was lost"


def test_a_killed_worker_is_named_lost_at_once_and_the_static_group_goes_on_and_shuts_down() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    sent, results = CONTEXT.Queue(), CONTEXT.Queue()
    # Separate events: killing a process that waits on an event breaks that event for the others.
    killed, release_k1, never = CONTEXT.Event(), CONTEXT.Event(), CONTEXT.Event()
    targets: Targets = [
        (static_survivor_k0, (init_method, sent, killed, results, release_k1)),
        (serve_until_told, ("k1", 1, 3, init_method, results, release_k1)),
        (serve_until, ("k2", 2, 3, init_method, never)),
    ]
    with spawned(targets, timeout=60) as workers, _no_leftovers(workers):
        assert sent.get(timeout=_REPORT_S) == "sent"
        workers[2].kill()
        workers[2].join(10)
        killed.set()
        reports = [_get(results, workers) for _ in range(4)]
    report = next(r[1] for r in reports if r[0] == "report")
    done = {r[1]: r[2:] for r in reports if r[0] == "done"}
    errors = [*report["pending"], report["new_call"][0], report["k1_call"][0]]
    assert all(e.startswith(f"ConnectionError: {_lost('k2', 2)}") for e in errors), errors
    assert report["pending_s"] < 1.0 and report["new_call"][1] < 1.0 and report["k1_call"][1] < 1.0, report
    assert (report["k0_to_k1"], report["k1_to_k0"]) == ("k1", "k0")
    assert report["k0_infos"] == report["k1_infos"] == ["k0", "k1"]
    for name in ("k0", "k1"):
        outcome, seconds, _ = done[name]
        assert outcome == "no error" and seconds < 10.0, (name, outcome, seconds)
    assert any("without k2, lost" in w for w in done["k0"][2]), done["k0"][2]
    assert [w.exitcode for w in workers] == [0, 0, -signal.SIGKILL]


def test_a_callback_of_a_call_failed_by_the_liveness_watch_does_not_stop_its_keepalives() -> None:
    # The watch failed k0's call to the stopped k2: had the call's callback (blocking for three
    # liveness timeouts) run on the watch's thread, k0 would have sent k1 nothing meanwhile, and
    # k1 would have judged k0 lost.
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    done1, done2 = CONTEXT.Event(), CONTEXT.Event()
    targets: Targets = [
        (survivor_whose_callback_blocks, ("k0", 0, 3, init_method, results)),
        (serve_until_liveness, ("k1", 1, 3, init_method, done1, 1.0)),
        (serve_until_liveness, ("k2", 2, 3, init_method, done2, 1.0)),
    ]
    with spawned(targets, timeout=60) as workers:
        assert _get(results, workers) == ("calling",)
        stopped = workers[2].pid
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)
        report = _get(results, workers)
        done1.set()
        workers[2].kill()
    assert report == ("report", "k1")


def test_survivors_of_a_killed_rank_0_shut_down_in_bounded_time_and_say_why() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    never, go1, go2 = CONTEXT.Event(), CONTEXT.Event(), CONTEXT.Event()
    targets: Targets = [
        (serve_until, ("r0", 0, 3, init_method, never)),
        (serve_until_told, ("r1", 1, 3, init_method, results, go1)),
        (serve_until_told, ("r2", 2, 3, init_method, results, go2)),
    ]
    with spawned(targets, timeout=60) as workers, _no_leftovers(workers):
        assert sorted(_get(results, workers)[1] for _ in range(2)) == ["r1", "r2"]
        workers[0].kill()
        workers[0].join(10)
        go1.set()
        go2.set()
        done = {r[1]: r[2:] for r in (_get(results, workers) for _ in range(2))}
    for name in ("r1", "r2"):
        outcome, seconds, warnings = done[name]
        assert outcome == "no error" and seconds < 10.0, (name, outcome, seconds, warnings)
        assert any(_lost("r0", 0) in w and "waits for its own calls only" in w for w in warnings), warnings
    assert [w.exitcode for w in workers] == [-signal.SIGKILL, 0, 0]


def test_a_killed_member_leaves_the_dynamic_group_and_a_new_worker_joins_under_its_name() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    killed, joined, leave1, never, leave_new = (CONTEXT.Event() for _ in range(5))
    targets: Targets = [
        (dynamic_host_d0, (init_method, killed, joined, results)),
        (serve_until_told, ("d1", 1, None, init_method, results, leave1)),
        (serve_until_told, ("d2", 2, None, init_method, results, never)),
    ]
    with spawned(targets, timeout=60) as workers, _no_leftovers(workers):
        reports = [_get(results, workers) for _ in range(3)]  # d1 and d2 ready, d0 sent its calls
        assert sorted(r[0] for r in reports) == ["ready", "ready", "sent"]
        workers[2].kill()
        workers[2].join(10)
        killed.set()
        tag, report = _get(results, workers)
        assert tag == "report"
        with spawned([(dynamic_joiner, ("d2", 3, init_method, results, leave_new))], timeout=60) as new:
            joiner = _get(results, [*workers, *new])
            joined.set()
            after = _get(results, [*workers, *new])
            leave_new.set()
            leave1.set()
            done = {r[1]: r[2:] for r in (_get(results, [*workers, *new]) for _ in range(3))}
        assert [w.exitcode for w in new] == [0]
    errors = [*report["pending"], report["new_call"][0], report["d1_call"][0]]
    assert all(_lost("d2", 2) in e for e in errors), errors
    # A name that left the group is unknown: naming it raises WorkerNameError (as for one that left).
    assert report["new_call"][0].startswith("WorkerNameError: worker_name='d2': could not find destination")
    assert report["pending_s"] < 1.0 and report["new_call"][1] < 1.0 and report["d1_call"][1] < 1.0, report
    assert report["d0_infos"] == report["d1_infos"] == ["d0", "d1"]
    assert report["store_cleared"], report["stored"]
    assert joiner == ("joined", ["d0", "d1", "d2"], "d0", "d1")
    assert after == ("after_join", {"d0_infos": [("d0", 0), ("d1", 1), ("d2", 3)], "d0_to_new_d2": "d2"})
    assert all(outcome == "no error" for outcome, _, _ in done.values()), done
    assert [w.exitcode for w in workers] == [0, 0, -signal.SIGKILL]


def test_a_frozen_member_is_lost_after_the_liveness_timeout_and_refused_when_it_resumes() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    stopped, leave1, resumed, zombie_done = (CONTEXT.Event() for _ in range(4))
    targets: Targets = [
        (frozen_host_f0, (init_method, stopped, results, zombie_done, _LIVENESS_S)),
        (serve_until_told, ("f1", 1, None, init_method, results, leave1, _LIVENESS_S)),
        (zombie_f2, (init_method, results, resumed, _LIVENESS_S)),
    ]
    with spawned(targets, timeout=60) as workers, _no_leftovers(workers):
        reports = [_get(results, workers) for _ in range(3)]
        assert sorted(r[0] for r in reports) == ["ready", "ready", "sent"]
        frozen = workers[2].pid
        assert frozen is not None
        os.kill(frozen, signal.SIGSTOP)
        try:
            stopped.set()
            tag, report = _get(results, workers)
        finally:
            os.kill(frozen, signal.SIGCONT)
        assert tag == "report"
        resumed.set()
        zombie = _get(results, workers)
        zombie_done.set()
        leave1.set()
        done = {r[1]: r[2:] for r in (_get(results, workers) for _ in range(2))}
    errors = [*report["pending"], report["new_call"][0], report["f1_call"][0]]
    assert all(_lost("f2", 2) in e for e in errors), errors
    assert "it sent nothing for" in report["pending"][0], report["pending"]
    bound = _LIVENESS_S + 2.0
    assert report["pending_s"] < bound and report["f1_call"][1] < bound, report
    assert report["new_call"][1] < 1.0, report
    assert report["f0_to_f1"] == "f1"
    assert report["f0_infos"] == report["f1_infos"] == ["f0", "f1"]
    assert zombie[0] == "zombie" and "worker f0 (rank 0) refuses f2: it judged f2 lost" in zombie[1][-1], (
        zombie
    )
    assert all(outcome == "no error" for outcome, _, _ in done.values()), done
    assert [w.exitcode for w in workers] == [0, 0, 0]
