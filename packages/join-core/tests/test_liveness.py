"""A rank that dies, freezes or goes quiet inside a Join: every other rank
raises RankLostError naming it within seconds, and a slow rank is not lost."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from counting_joinable import CountingJoinable

from join_core import Join, RankLostError
from join_core.liveness import _decode
from join_core.testing import RanksFailedError, run_ranks

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
    assert "exit code -9" in failed.value.failures[2]


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


def test_endpoints_read_from_the_store_are_parsed_defensively() -> None:
    assert _decode(b"127.0.0.1,80;::ffff:10.0.0.1,9;garbage;1.2.3.4,0;1.2.3.4,70000;x,5;;") == {
        ("127.0.0.1", 80),
        ("10.0.0.1", 9),
    }
    assert _decode(b"1.2.3.4,5;" * 10_000) == set()  # over the size limit: ignored
    assert _decode(bytes(range(256))) == set()
