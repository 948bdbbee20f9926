"""ShadowCollectives across real gloo process groups: joined ranks shadow the
collectives of the loop body, the sequence is checked once a rank joined, and
nothing of the interception outlives the context."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting_joinable import CountingJoinable

from join_core import CollectiveMismatchError, Join, ShadowCollectives
from join_core.testing import RanksFailedError, run_ranks

CARRIES = pytest.mark.parametrize("carries", [False, True], ids=["heartbeat-allreduce", "heartbeat-carried"])
BASE = 2  # rank r runs BASE + r iterations


def _active(world_size: int, step: int) -> list[int]:
    return [r for r in range(world_size) if BASE + r > step]


def _metric_loop(rank: int, world_size: int, carries: bool) -> list[list[float]]:
    counting = CountingJoinable(carries)
    seen = []
    with Join([counting, ShadowCollectives()]):
        for _ in range(BASE + rank):
            counting.step(1.0)
            value = float(rank + 1)
            stats = torch.tensor([value, value])
            dist.all_reduce(stats)
            low, high, product = torch.tensor([value]), torch.tensor([value]), torch.tensor([value])
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(product, op=dist.ReduceOp.PRODUCT)
            seen.append([*stats.tolist(), low.item(), high.item(), product.item()])
    return seen


@CARRIES
def test_joined_ranks_shadow_the_loop_bodys_all_reduces(carries: bool) -> None:
    world_size = 3
    results = run_ranks(_metric_loop, world_size, carries)
    for rank, seen in enumerate(results):
        for step, row in enumerate(seen):
            values = [float(r + 1) for r in _active(world_size, step)]
            product = 1.0
            for v in values:
                product *= v
            assert row == [sum(values), sum(values), min(values), max(values), product], (rank, step)


def _extra_every_third(rank: int, world_size: int) -> tuple[str, float]:
    counting = CountingJoinable(True)
    start = time.monotonic()
    try:
        with Join([counting, ShadowCollectives()]):
            for step in range(BASE + 2 * rank):
                counting.step(1.0)
                dist.all_reduce(torch.ones(1))
                if step % 3 == 2:
                    dist.all_reduce(torch.ones(4))
    except CollectiveMismatchError as error:
        return str(error), time.monotonic() - start
    return "", time.monotonic() - start


def test_changing_sequence_raises_on_every_rank() -> None:
    results = run_ranks(_extra_every_third, 3, timeout=60)
    for rank, (message, elapsed) in enumerate(results):
        # Every rank names the extra op; the training ranks also where it is issued.
        assert "differ" in message
        assert "ranks 1, 2 (training): all_reduce of 4 float32 elements" in message
        assert "rank 0 (joined): all_reduce of 2 float32 elements" in message
        assert (
            f"Rank {rank} issues all_reduce(float32[4], op=SUM) at test_shadow_collectives.py" in message
        ) == (rank > 0)
        assert elapsed < 30


def _first(rank: int, world_size: int) -> str:
    try:
        with Join([ShadowCollectives(), CountingJoinable(False)]):
            pass
    except ValueError as error:
        return str(error)
    return ""


def test_shadow_collectives_cannot_come_first() -> None:
    for message in run_ranks(_first, 2):
        assert "cannot be first" in message


def _scoped(rank: int, world_size: int) -> dict[str, Any]:
    original = dist.all_reduce
    other = dist.new_group(list(range(world_size)))
    counting = CountingJoinable(False)
    shadow = ShadowCollectives()
    seen_inside: list[bool] = []
    other_results: list[float] = []

    def on_other_group() -> None:
        # Another thread's collectives on another group pass untouched.
        for _ in range(20):
            value = torch.ones(1)
            dist.all_reduce(value, group=other)
            other_results.append(value.item())

    with Join([counting, shadow]):
        seen_inside.append(dist.all_reduce is not original)
        thread = threading.Thread(target=on_other_group)
        thread.start()
        for _ in range(BASE + rank):
            counting.step(1.0)
            dist.all_reduce(torch.ones(1))
        thread.join(timeout=60)
    restored_after_exit = dist.all_reduce is original
    failed_inside = False
    try:
        with Join([CountingJoinable(False), ShadowCollectives()]):
            raise KeyError("fails inside")
    except KeyError:
        failed_inside = True
    return {
        "inside": seen_inside,
        "restored": restored_after_exit,
        "restored_after_failure": failed_inside and dist.all_reduce is original,
        "other": other_results,
    }


def test_interception_lives_exactly_as_long_as_the_context() -> None:
    for result in run_ranks(_scoped, 2):
        assert result["inside"] == [True]
        assert result["restored"]
        assert result["restored_after_failure"]
        assert result["other"] == [2.0] * 20


def _avg(rank: int, world_size: int) -> str:
    try:
        with Join([CountingJoinable(False), ShadowCollectives()]):
            dist.all_reduce(torch.ones(1), op=dist.ReduceOp.AVG)
    except (ValueError, RuntimeError) as error:
        return str(error)
    return ""


def test_avg_cannot_be_shadowed_and_says_what_to_use() -> None:
    try:
        results = run_ranks(_avg, 2)
    except RanksFailedError as error:  # pragma: no cover - shows the ranks' tracebacks
        raise AssertionError(str(error)) from error
    for message in results:
        assert "ReduceOp.AVG" in message and "ReduceOp.SUM" in message


def _patched_meanwhile(rank: int, world_size: int) -> dict[str, Any]:
    original = dist.all_reduce
    calls: list[str] = []
    with Join([CountingJoinable(False), ShadowCollectives()]):
        ours = dist.all_reduce

        # Another library wraps the function while the context is entered.
        def theirs(*args: Any, **kwargs: Any) -> Any:
            calls.append("theirs")
            return ours(*args, **kwargs)

        dist.all_reduce = theirs
    left_in_place = dist.all_reduce is theirs
    calls.clear()  # Join's own heartbeats went through it too
    value = torch.ones(1)
    dist.all_reduce(value)  # theirs, then ours passing straight on
    dist.all_reduce = original
    return {"left_in_place": left_in_place, "calls": calls, "value": value.item()}


def test_a_function_replaced_by_someone_else_meanwhile_is_left_in_place() -> None:
    for result in run_ranks(_patched_meanwhile, 2):
        assert result == {"left_in_place": True, "calls": ["theirs"], "value": 2.0}
