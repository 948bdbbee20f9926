"""A rank that dies, freezes or goes quiet inside a Join: every other rank
raises RankLostError naming it within seconds, and a slow rank is not lost."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting_joinable import CountingJoinable

from join_core import Join, RankLostError, spare_connections
from join_core.liveness import _connections, _decode
from join_core.testing import RanksFailedError, run_ranks

# torch's stubs do not re-export the store class it documents publicly.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]

#: What the loss of a rank may take to be told, at the default liveness timeout.
TOLD_WITHIN_S = 10.0


def _pids(world_size: int) -> list[int]:
    pids = torch.zeros(world_size, dtype=torch.int64)
    pids[dist.get_rank()] = os.getpid()
    dist.all_reduce(pids)
    return [int(pid) for pid in pids]


def _lose_rank(rank: int, world_size: int, carries: bool, how: str) -> None:
    """Rank 2 is stopped or killed between iterations; the others check what
    they see and, whatever it is, kill it so that nothing outlives the test."""
    pids = _pids(world_size)
    joinable = CountingJoinable(carries)
    last_step = time.monotonic()
    try:
        with Join([joinable]):
            for i in range(100_000):
                if rank == 2 and i == 3:
                    os.kill(os.getpid(), signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
                joinable.step(1.0)
                last_step = time.monotonic()
        raise AssertionError("the loop ended without noticing the lost rank")
    except RankLostError as error:
        told_after = time.monotonic() - last_step
        assert list(error.ranks) == [2], str(error)
        assert str(error).startswith("Join aborted: lost rank 2 (no heartbeat for "), str(error)
        assert told_after < TOLD_WITHIN_S, f"told after {told_after:.1f} s"
    finally:
        if rank != 2:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[2], signal.SIGKILL)


@pytest.mark.parametrize("carries", [False, True], ids=["heartbeat-allreduce", "heartbeat-carried"])
@pytest.mark.parametrize("how", ["freeze", "kill"])
def test_every_surviving_rank_names_a_lost_rank_within_seconds(carries: bool, how: str) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_lose_rank, 3, carries, how, timeout=60)
    # Only the lost rank failed: the survivors' own checks passed.
    assert list(failed.value.failures) == [2], str(failed.value)
    assert "exited with code -9" in failed.value.failures[2]


def _freeze_under_a_watch(rank: int, world_size: int) -> None:
    """Rank 1 freezes in a script watched by watch_collectives (no Join); rank 0 checks what it is told."""
    from join_core import watch_collectives

    pids = _pids(world_size)
    watch_collectives(liveness_timeout=timedelta(seconds=2), hang_timeout=None)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        with pytest.raises(RankLostError) as lost:
            dist.all_reduce(torch.ones(1))
        told = str(lost.value)
        # The watch sees the silence at its next look: 2 s and a fraction.
        assert re.match(r"watch_collectives: lost rank 1 \(no heartbeat for 2\.\d s", told), told
        assert told.endswith(
            "the process group cannot complete a collective any more: destroy it and restart the job (a "
            "training loop under Join(on_rank_lost='continue') goes on without it)"
        ), told
    finally:
        os.kill(pids[1], signal.SIGKILL)


def test_a_rank_lost_under_watch_collectives_is_told_by_the_watch_not_by_a_join() -> None:
    # It said "Join aborted: ..." and advised passing Join(on_rank_lost='continue'), in a script without a Join.
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_freeze_under_a_watch, 2, timeout=60)
    assert list(failed.value.failures) == [1], str(failed.value)


def _start_again_after_a_loss(rank: int, world_size: int, path: str) -> None:
    """Rank 2 is killed; the survivors destroy the process group and make a new one in the same
    process (the default group gets the same name again): the verdict must not follow them."""
    joinable = CountingJoinable(False)
    with contextlib.suppress(RankLostError), Join([joinable]):
        for i in range(100_000):
            if rank == 2 and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            joinable.step(1.0)
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    assert dist.group.WORLD.group_name == name  # type: ignore[union-attr]
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2.0


def test_survivors_that_make_a_new_process_group_in_the_same_process_can_use_it(tmp_path: Path) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_start_again_after_a_loss, 3, str(tmp_path / "store"), timeout=60)
    assert list(failed.value.failures) == [2], str(failed.value)


def _hog_the_gil(seconds: float) -> None:
    """Keep the GIL from every other thread for up to 3 s at a time, for ``seconds``: the
    watch thread runs late, as on a loaded host."""
    sys.setswitchinterval(3.0)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    sys.setswitchinterval(0.005)


def _lose_joined_rank_on_a_loaded_host(rank: int, world_size: int) -> None:
    """Rank 2 runs out of inputs, shadows the others' collectives and is killed there; the
    survivors' watch threads are held up meanwhile."""
    pids = _pids(world_size)
    joinable = CountingJoinable(False)
    start = time.monotonic()
    if rank == 2:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        threading.Timer(1.2, _hog_the_gil, (6.0,)).start()
    try:
        with Join([joinable]):
            for _ in range(2 if rank == 2 else 100_000):
                joinable.step(1.0)
                time.sleep(0.01)
        raise AssertionError("the loop ended without noticing the lost rank")
    except RankLostError as error:
        assert list(error.ranks) == [2], str(error)
        assert time.monotonic() - start < 25, f"told after {time.monotonic() - start:.1f} s"
    finally:
        if rank != 2:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[2], signal.SIGKILL)


def test_every_survivor_names_a_joined_rank_killed_while_their_watch_runs_late() -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_lose_joined_rank_on_a_loaded_host, 3, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)
    assert "exited with code -9" in failed.value.failures[2]


def _slow(rank: int, world_size: int) -> list[float]:
    joinable = CountingJoinable(True)
    with Join([joinable], liveness_timeout=timedelta(seconds=1)):
        for i in range(4 + rank):
            if rank == 1 and i == 1:
                time.sleep(3)  # three timeouts of computation, heartbeats going on
            joinable.step(1.0)
    return joinable.sums


def test_a_slow_rank_is_not_lost() -> None:
    results = run_ranks(_slow, 2, timeout=60)
    assert results[0] == [2.0] * 4 + [1.0, 0.0]


def _bad_timeout(rank: int, world_size: int) -> str:
    try:
        Join([CountingJoinable(False)], liveness_timeout=timedelta(0))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_liveness_timeout_that_is_not_positive_is_refused() -> None:
    [message] = run_ranks(_bad_timeout, 1)
    assert message == (
        "Join(liveness_timeout=datetime.timedelta(0)): must be positive; pass None to turn it off"
    )


def _timeouts_of_other_types(rank: int, world_size: int) -> list[str]:
    from join_core import watch_collectives

    attempts: list[Callable[[], object]] = [
        lambda: Join([CountingJoinable(False)], liveness_timeout=30.0),  # type: ignore[arg-type]
        lambda: Join([CountingJoinable(False)], hang_timeout="5s"),  # type: ignore[arg-type]
        lambda: watch_collectives(liveness_timeout=None),  # type: ignore[arg-type]
        lambda: watch_collectives(hang_timeout=timedelta(0)),
        lambda: Join([CountingJoinable(False)], liveness_timeout=timedelta(microseconds=1)),
    ]
    outcomes = []
    for attempt in attempts:
        try:
            attempt()
        except (TypeError, ValueError) as error:
            outcomes.append(f"{type(error).__name__}: {error}")
        else:
            outcomes.append("no error")
    return outcomes


def test_timeouts_that_are_not_positive_timedeltas_are_refused_naming_the_argument() -> None:
    [outcomes] = run_ranks(_timeouts_of_other_types, 1)
    assert outcomes == [
        "TypeError: Join(liveness_timeout=30.0): must be a datetime.timedelta, e.g. timedelta(seconds=30); "
        "pass None to turn it off",
        "TypeError: Join(hang_timeout='5s'): must be a datetime.timedelta, e.g. timedelta(seconds=30); "
        "pass None to turn it off",
        "TypeError: watch_collectives(liveness_timeout=None): must be a datetime.timedelta, e.g. "
        "timedelta(seconds=30)",
        "ValueError: watch_collectives(hang_timeout=datetime.timedelta(0)): must be positive; pass None to "
        "turn it off",
        "ValueError: Join(liveness_timeout=datetime.timedelta(microseconds=1)): must be at least 0.1 s "
        "(heartbeats go every fifth of the liveness timeout through the store); pass None to turn it off",
    ]


def test_endpoints_read_from_the_store_are_parsed_defensively() -> None:
    assert _decode(b"127.0.0.1,80;::ffff:10.0.0.1,9;garbage;1.2.3.4,0;1.2.3.4,70000;x,5;;") == (
        {("127.0.0.1", 80), ("10.0.0.1", 9)},
        False,
    )
    assert _decode(b"store;1.2.3.4,5") == ({("1.2.3.4", 5)}, True)
    assert _decode(b"store;1.2.3.4,5;" * 10_000) == (set(), False)  # over the size limit: ignored
    assert _decode(bytes(range(256))) == (set(), False)


def _rank_serving_the_store(
    rank: int, world_size: int, port: int, results: multiprocessing.Queue[str]
) -> None:
    """As launched by hand with MASTER_ADDR: rank 0's process serves the store,
    and rank 0 is killed."""
    try:
        store = TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=60),
            wait_for_workers=False,
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        joinable = CountingJoinable(True)
        last_step = start = time.monotonic()
        with Join([joinable]):
            for _ in range(1_000_000):
                if rank == 0 and time.monotonic() - start > 2:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-training
                joinable.step(1.0)
                last_step = time.monotonic()
        results.put(f"rank {rank}: the loop ended without noticing the lost rank")
    except RankLostError as error:
        told_after = time.monotonic() - last_step
        ok = list(error.ranks) == [0] and told_after < TOLD_WITHIN_S
        results.put("ok" if ok else f"rank {rank}: told after {told_after:.1f} s: {error}")
    except BaseException as error:  # noqa: BLE001 - reported to the test
        results.put(f"rank {rank}: {type(error).__name__}: {error}")


def test_the_rank_serving_the_store_is_named_when_lost() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = multiprocessing.get_context("forkserver")
    results: multiprocessing.Queue[str] = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_serving_the_store, args=(rank, 3, port, results), daemon=True)
        for rank in range(3)
    ]
    for proc in procs:
        proc.start()
    try:
        seen = [results.get(timeout=60) for _ in range(2)]
    finally:
        for proc in procs:
            proc.kill()
            proc.join(timeout=10)
        results.close()
    assert seen == ["ok", "ok"]
    assert procs[0].exitcode == -signal.SIGKILL


def _frozen_rank_beside_the_store(
    rank: int, world_size: int, port: int, results: multiprocessing.Queue[str]
) -> None:
    """Rank 0 serves the store and leaves as soon as it names the frozen rank 2;
    rank 1's watch lags behind rank 0's (a longer liveness timeout, as a loaded
    host gives)."""
    try:
        store = TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=60),
            wait_for_workers=False,
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        joinable = CountingJoinable(True)
        start = time.monotonic()
        with Join([joinable], liveness_timeout=timedelta(seconds=8 if rank == 1 else 4)):
            for _ in range(1_000_000):
                if rank == 2 and time.monotonic() - start > 2:
                    os.kill(os.getpid(), signal.SIGSTOP)
                joinable.step(1.0)
        results.put(f"rank {rank}: the loop ended without noticing the lost rank")
    except RankLostError as error:
        results.put("ok" if list(error.ranks) == [2] else f"rank {rank}: {error}")
    except BaseException as error:  # noqa: BLE001 - reported to the test
        results.put(f"rank {rank}: {type(error).__name__}: {error}")


def test_every_survivor_names_the_frozen_rank_when_the_store_serving_rank_leaves_first() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = multiprocessing.get_context("forkserver")
    results: multiprocessing.Queue[str] = ctx.Queue()
    procs = [
        ctx.Process(target=_frozen_rank_beside_the_store, args=(rank, 3, port, results), daemon=True)
        for rank in range(3)
    ]
    for proc in procs:
        proc.start()
    try:
        seen = [results.get(timeout=60) for _ in range(2)]
    finally:
        for proc in procs:
            proc.kill()
            proc.join(timeout=10)
        results.close()
    assert seen == ["ok", "ok"]


def _store_unreachable(rank: int, world_size: int) -> str:
    def no_store(group: dist.ProcessGroup) -> Any:
        raise RuntimeError("no store for this group")

    dist.ProcessGroup.get_group_store = no_store  # type: ignore[method-assign, assignment]
    try:
        with Join([CountingJoinable(False)]):  # the watch is on by default
            pass
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_watch_that_cannot_start_raises_its_own_error() -> None:
    assert run_ranks(_store_unreachable, 2) == ["no store for this group"] * 2


def test_a_port_is_spared_until_every_holder_released_it() -> None:
    """After a loss the watch shuts down this process's connections but the spared ones; an RPC
    agent's port is spared while it listens, and watched again after (it may be reused)."""

    def watched_ports() -> set[int]:
        found = _connections(None)
        for sock, _, _ in found:
            sock.close()
        return {local[1] for _, local, _ in found}

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)), listener.accept()[0]:
            assert port in watched_ports()
            first, second = spare_connections(port), spare_connections(port)
            assert port not in watched_ports()
            first()
            first()  # a second call does nothing: the other holder still spares it
            assert port not in watched_ports()
            second()
            assert port in watched_ports()


def _keys_after_each_join(rank: int, world_size: int, joins: int) -> tuple[int, list[int]]:
    """The store's key count before any Join, and once each of ``joins`` Joins in
    a row ended on every rank (waiting up to 10 s for it to come back down)."""
    store = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]
    before = int(store.num_keys())
    counts = []
    for index in range(joins):
        joinable = CountingJoinable(False)
        with Join([joinable], liveness_timeout=timedelta(seconds=2)):
            for _ in range(3 + rank * index):  # uneven, and long enough for the watch's own client
                joinable.step(1.0)
                time.sleep(0.1)
        dist.barrier()
        deadline = time.monotonic() + 10  # each watch's thread ends within a store round trip of its Join
        while int(store.num_keys()) > before and time.monotonic() < deadline:
            time.sleep(0.05)
        counts.append(int(store.num_keys()))
        dist.barrier()
    return before, counts


def test_joins_in_a_row_leave_no_keys_behind_in_the_store() -> None:
    # A job that runs a Join per epoch must not grow the store by each Join's
    # heartbeats and connections: once every rank left one, its keys go.
    before, counts = run_ranks(_keys_after_each_join, 3, 4, timeout=90)[0]
    assert counts == [before] * 4, (before, counts)


def _without_a_store_client_of_its_own(rank: int, world_size: int) -> str:
    """Rank 1 cannot make a store client of its own; the Join lasts several liveness timeouts."""
    import join_core.liveness

    if rank == 1:

        def refused(store: Any, timeout: timedelta) -> Any:
            raise RuntimeError("no client for you")

        join_core.liveness._own_client = refused
    joinable = CountingJoinable(False)
    with Join([joinable], liveness_timeout=timedelta(seconds=2)):
        for _ in range(16):  # 4 s: a rank that never beats is judged lost within them
            joinable.step(1.0)
            time.sleep(0.25)
    return "done"


def test_a_rank_without_a_store_client_of_its_own_still_beats_and_is_not_lost() -> None:
    assert run_ranks(_without_a_store_client_of_its_own, 2, timeout=60) == ["done", "done"]
