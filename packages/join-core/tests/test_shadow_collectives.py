"""ShadowCollectives across real gloo process groups: joined ranks shadow the
collectives of the loop body, the sequence is checked once a rank joined, and
nothing of the interception outlives the context."""

from __future__ import annotations

import _thread
import os
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting_joinable import CountingJoinable
from torch.distributed import all_reduce as imported_all_reduce

from join_core import CollectiveMismatchError, Join, OwnedCollectives, ShadowCollectives, intercept
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
        seen_inside.append(intercept.watched(shadow.process_group))
        thread = threading.Thread(target=on_other_group)
        thread.start()
        for _ in range(BASE + rank):
            counting.step(1.0)
            dist.all_reduce(torch.ones(1))
        thread.join(timeout=60)
    restored_after_exit = not intercept.watched(shadow.process_group)
    failed_inside = False
    try:
        with Join([CountingJoinable(False), ShadowCollectives()]):
            raise KeyError("fails inside")
    except KeyError:
        failed_inside = True
    return {
        "inside": seen_inside,
        "restored": restored_after_exit,
        "restored_after_failure": failed_inside and not intercept.watched(shadow.process_group),
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


# Code that torch's own threads run: compiled under torch's folder, started with
# _thread so that no frame outside torch is on its stack (as on the thread where
# autograd runs a CUDA backward, FSDP2's reduce-scatters with ReduceOp.AVG included).
_TORCH_THREAD_SOURCE = """
def issue(result):
    try:
        tensor = torch.ones(1)
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        result.append(str(float(tensor)))
    except Exception as error:
        result.append(repr(error))
"""


def _owned_from_torchs_own_thread(rank: int, world_size: int) -> str:
    namespace: dict[str, Any] = {"torch": torch, "dist": dist}
    filename = os.path.join(os.path.dirname(torch.__file__), "_owned_thread.py")
    exec(compile(_TORCH_THREAD_SOURCE, filename, "exec"), namespace)
    result: list[str] = []
    with Join([CountingJoinable(False), ShadowCollectives()]), OwnedCollectives("Owner"):
        _thread.start_new_thread(namespace["issue"], (result,))
        deadline = time.monotonic() + 30
        while not result and time.monotonic() < deadline:
            time.sleep(0.01)
    return result[0] if result else "no result within 30 s"


def test_owned_collectives_issued_from_torchs_own_threads_stay_the_owners() -> None:
    # They were taken for Join's heartbeat, and ReduceOp.AVG refused.
    assert run_ranks(_owned_from_torchs_own_thread, 2) == ["1.0", "1.0"]


def _every_kind(rank: int, world_size: int) -> list[dict[str, list[float]]]:
    counting = CountingJoinable(False)
    seen = []
    with Join([counting, ShadowCollectives()]):
        for _ in range(BASE + world_size - 1 - rank):  # rank 0, every root, trains longest
            counting.step(1.0)
            mine = float(rank + 1)
            summed = torch.tensor([mine])
            imported_all_reduce(summed)
            gathered = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None
            dist.gather(torch.tensor([mine]), gathered, dst=0)
            scattered = torch.zeros(1)
            chunks = [torch.tensor([10.0 + r]) for r in range(world_size)] if rank == 0 else None
            dist.scatter(scattered, chunks, src=0)
            exchanged = torch.zeros(world_size)
            dist.all_to_all_single(exchanged, torch.tensor([10.0 * rank + r for r in range(world_size)]))
            everyone = torch.zeros(world_size)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated in newer torch, still shadowed
                dist.all_gather_into_tensor(everyone, torch.tensor([mine]))
                part = torch.zeros(1)
                dist.reduce_scatter_tensor(part, torch.full((world_size,), mine))
            later = torch.tensor([mine])
            work = dist.all_reduce(later, async_op=True)
            assert work is not None
            work.wait()
            seen.append(
                {
                    "summed": summed.tolist(),
                    "gathered": [t.item() for t in gathered] if gathered is not None else [],
                    "scattered": scattered.tolist(),
                    "exchanged": exchanged.tolist(),
                    "everyone": everyone.tolist(),
                    "part": part.tolist(),
                    "later": later.tolist(),
                }
            )
    return seen


def test_joined_ranks_shadow_every_kind_of_collective_however_called() -> None:
    world_size = 3
    results = run_ranks(_every_kind, world_size)
    for rank, seen in enumerate(results):
        for step, row in enumerate(seen):
            active = [r for r in range(world_size) if BASE + world_size - 1 - r > step]
            total = float(sum(r + 1 for r in active))
            values = [float(r + 1) if r in active else 0.0 for r in range(world_size)]
            assert row["summed"] == [total] and row["later"] == [total], (rank, step, row)
            assert row["gathered"] == (values if rank == 0 else []), (rank, step, row)
            assert row["scattered"] == [10.0 + rank], (rank, step, row)
            assert row["exchanged"] == [10.0 * r + rank if r in active else 0.0 for r in range(world_size)], (
                row
            )
            assert row["everyone"] == values and row["part"] == [total], (rank, step, row)
