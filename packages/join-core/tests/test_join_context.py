"""Join across real gloo process groups: uneven inputs, early termination,
failures, and what a healthy iteration costs."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from counting_joinable import CountingHook, CountingJoinable

from join_core import Join, Joinable, JoinAbortedError, JoinHook
from join_core.testing import run_ranks

CARRIES = pytest.mark.parametrize("carries", [False, True], ids=["heartbeat-allreduce", "heartbeat-carried"])


def _uneven(rank: int, world_size: int, carries: bool, base: int) -> dict[str, Any]:
    first, second = CountingJoinable(carries), CountingJoinable(False)
    with Join([first, second], marker="kw"):
        for _ in range(base + rank):
            first.step(1.0)
            second.step(10.0)
    return {
        "sums": first.sums,
        "main_hook_calls": (first.main_hook_calls, second.main_hook_calls),
        "post": (first.post_hook_calls, second.post_hook_calls),
        "second_notify": [w is None for w in second.notify_results],
        "first_notify": [w is None for w in first.notify_results],
    }


@CARRIES
def test_joined_ranks_shadow_until_the_last_rank_finishes(carries: bool) -> None:
    world_size, base = 3, 2
    results = run_ranks(_uneven, world_size, carries, base)
    longest = base + world_size - 1
    for rank, result in enumerate(results):
        # The value all-reduced at iteration i is the number of ranks still training;
        # a carried heartbeat also runs the all-reduce that finds every rank joined.
        expected = [float(sum(1 for r in range(world_size) if base + r > i)) for i in range(longest)]
        assert result["sums"] == expected + [0.0] * carries
        shadowed = longest - (base + rank)
        assert result["main_hook_calls"] == (shadowed + carries, shadowed)
        last = rank == world_size - 1
        assert result["post"] == ([last], [last])
        assert all(result["second_notify"])
        # The first joinable's notify sends the heartbeat unless it carries it.
        assert all(result["first_notify"]) == carries


def _hook_kwargs(rank: int, world_size: int) -> dict[str, Any]:
    joinable = CountingJoinable(False)
    join = Join([joinable], some_option=rank)
    hook = join._hooks[0]
    assert isinstance(hook, CountingHook)
    with join:
        joinable.step(1.0)
    return hook.kwargs


def test_kwargs_reach_every_join_hook() -> None:
    assert run_ranks(_hook_kwargs, 2) == [{"some_option": 0}, {"some_option": 1}]


def _throw(rank: int, world_size: int, carries: bool) -> str:
    joinable = CountingJoinable(carries)
    try:
        with Join([joinable], throw_on_early_termination=True):
            for _ in range(3 + (rank != 0) * 5):
                joinable.step(1.0)
    except RuntimeError as error:
        return str(error)
    return "no error"


@CARRIES
def test_early_termination_raises_on_every_rank(carries: bool) -> None:
    messages = run_ranks(_throw, 3, carries)
    assert messages[0] == "Rank 0 exhausted all inputs."
    for message in messages[1:]:
        assert message == "Detected at least one rank that exhausted inputs. Throwing across all ranks."


def _fail(rank: int, world_size: int, carries: bool, where: str) -> tuple[str, str, float]:
    joinable = CountingJoinable(carries)
    start = time.monotonic()
    try:
        with Join([joinable]):
            for i in range(6 if rank != 2 else 1):
                if rank == 1 and i == 3:
                    if where == "between-iterations":
                        raise ValueError("bad batch")
                    joinable.step(1.0, fail_between_collectives=True)
                joinable.step(1.0)
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error), time.monotonic() - start
    return "none", "", time.monotonic() - start


@CARRIES
@pytest.mark.parametrize("where", ["between-iterations", "between-collectives"])
def test_failure_on_one_rank_reaches_every_rank(carries: bool, where: str) -> None:
    results = run_ranks(_fail, 3, carries, where, timeout=60)
    reason = (
        "ValueError: bad batch" if where == "between-iterations" else "ValueError: failed between collectives"
    )
    kind, message, _ = results[1]
    assert kind == "ValueError"
    for rank in (0, 2):  # rank 2 had already joined
        kind, message, elapsed = results[rank]
        assert kind == "JoinAbortedError"
        assert message == f"Join aborted: rank 1 raised {reason}"
        assert elapsed < 30


def _aborted_error_fields(rank: int, world_size: int) -> dict[int, str]:
    joinable = CountingJoinable(True)
    try:
        with Join([joinable]):
            joinable.step(1.0)
            if rank == 0:
                raise KeyError("missing")
            joinable.step(1.0)
    except JoinAbortedError as error:
        return error.failures
    except KeyError:
        return {}
    raise AssertionError("no error")


def test_aborted_error_lists_the_failing_rank_and_reason() -> None:
    assert run_ranks(_aborted_error_fields, 2) == [{}, {0: "KeyError: 'missing'"}]


def _skew(rank: int, world_size: int, iterations: int) -> tuple[list[str], list[float], bool]:
    filters_before = list(warnings.filters)
    joinable = CountingJoinable(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([joinable]):
            for _ in range(iterations if rank == 1 else 0):
                joinable.step(1.0)
    unchanged = list(warnings.filters) == filters_before
    return [str(w.message) for w in caught], joinable.sums, unchanged


def test_large_skew_completes_and_warns_once() -> None:
    iterations = 5000
    (warned, shadowed, unchanged), (other, trained, _) = run_ranks(_skew, 2, iterations)
    assert len(warned) == 1 and warned[0].startswith("Detected uneven input skew of greater than 1000.")
    assert other == []
    assert trained == [1.0] * iterations + [0.0]
    assert shadowed == [1.0] * iterations + [0.0]
    assert unchanged


def _filters_untouched(rank: int, world_size: int) -> bool:
    warnings.simplefilter("error", DeprecationWarning)
    before = list(warnings.filters)
    joinable = CountingJoinable(False)
    with Join([joinable]):
        for _ in range(1 + rank):
            joinable.step(1.0)
    return list(warnings.filters) == before


def test_join_leaves_warning_filters_alone() -> None:
    assert run_ranks(_filters_untouched, 2) == [True, True]


def _disabled(rank: int, world_size: int) -> tuple[list[bool], int, list[bool]]:
    joinable = CountingJoinable(False)
    with Join([joinable], enable=False):
        for _ in range(3):
            joinable.step(1.0)
    return [w is None for w in joinable.notify_results], joinable.main_hook_calls, joinable.post_hook_calls


def test_disabled_join_runs_no_join_logic() -> None:
    assert run_ranks(_disabled, 2) == [([True] * 3, 0, [])] * 2


def _companions(rank: int, world_size: int) -> list[list[int]]:
    joinables: list[Joinable] = [CountingJoinable(False) for _ in range(3)]

    def seen() -> list[int]:
        return [len(Join.companions(j)) for j in joinables] + [
            next(i for i, j in enumerate(joinables) if j is other) for other in Join.companions(joinables[1])
        ]

    before = seen()
    with Join(joinables):
        inside = seen()
    with Join(joinables, enable=False):
        disabled = seen()
    return [before, inside, disabled, seen()]


def test_companions_are_the_other_joinables_of_the_entered_join_in_order() -> None:
    assert run_ranks(_companions, 2) == [[[0, 0, 0], [2, 2, 2, 0, 2], [0, 0, 0], [0, 0, 0]]] * 2


def _collectives_per_iteration(rank: int, world_size: int, carries: bool, joined: bool) -> int:
    from torch.profiler import ProfilerActivity, profile

    joinable = CountingJoinable(carries)
    with profile(activities=[ProfilerActivity.CPU]) as prof, Join([joinable], enable=joined):
        for _ in range(10):
            joinable.step(1.0)
    return sum(1 for event in prof.events() if event.name.startswith("gloo:"))


def test_carried_heartbeat_adds_no_collective() -> None:
    without_join = run_ranks(_collectives_per_iteration, 2, True, False)
    carried = run_ranks(_collectives_per_iteration, 2, True, True)
    separate = run_ranks(_collectives_per_iteration, 2, False, True)
    # 10 iterations of two collectives; leaving the Join costs one all-reduce
    # that finds every rank joined. A separate heartbeat adds one per iteration.
    assert without_join == [20, 20]
    assert carried == [20 + 1] * 2
    assert separate == [20 + 10 + 1] * 2


def _process_groups(rank: int, world_size: int) -> str:
    other: dist.ProcessGroup = dist.new_group([0, 1])

    class OtherGroup(CountingJoinable):
        @property
        def join_process_group(self) -> dist.ProcessGroup:
            return other

    try:
        Join([CountingJoinable(False), OtherGroup(False)])
    except ValueError as error:
        return str(error)
    return "no error"


def test_joinables_with_different_process_groups_are_refused() -> None:
    assert run_ranks(_process_groups, 2) == ["Using join context manager with multiple process groups"] * 2


def _none_and_world(rank: int, world_size: int) -> list[float]:
    class OnTheDefaultGroup:
        """A joinable without collectives, on None: the default group, as torch's may say."""

        join_device = torch.device("cpu")
        join_process_group = None

        def join_hook(self, **kwargs: Any) -> JoinHook:
            return JoinHook()

    world = CountingJoinable(False)
    with Join([world, OnTheDefaultGroup()]):
        for _ in range(2 + rank):
            world.step(1.0)
    return world.sums


def test_joinables_on_none_and_on_the_world_are_one_group() -> None:
    assert run_ranks(_none_and_world, 2) == [[2.0, 2.0, 1.0]] * 2


def test_empty_joinables_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one joinable"):
        Join([])


def test_non_joinable_is_refused_by_index() -> None:
    with pytest.raises(TypeError, match=r"joinables\[0\]=int"):
        Join([3])  # type: ignore[list-item]


class _Explicit(Joinable):
    def __init__(self) -> None:
        super().__init__()
        self.made = True

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return JoinHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        raise RuntimeError("not needed here")


def test_joinable_is_a_structural_and_an_explicit_base() -> None:
    explicit = _Explicit()
    assert explicit.made and isinstance(explicit, Joinable)
    assert isinstance(CountingJoinable(False), Joinable)
    assert not isinstance(object(), Joinable)


class _DefaultGroup(CountingJoinable):
    """Returns what torch's DDP returns by default: ``dist.group.WORLD``, which may be None."""

    @property
    def join_process_group(self) -> Any:
        return None


def _uneven_in_the_default_group(rank: int, world_size: int) -> list[float]:
    joinable = _DefaultGroup(True)
    with Join([joinable]):
        for _ in range(rank + 1):
            joinable.step(1.0)
    return joinable.sums


def test_a_joinable_whose_process_group_is_none_joins_in_the_default_group() -> None:
    # The last all-reduce is the one that finds every rank joined.
    assert run_ranks(_uneven_in_the_default_group, 2) == [[2.0, 1.0, 0.0]] * 2


def _nested(rank: int, world_size: int) -> str:
    joinable = CountingJoinable(False)
    with Join([joinable]):
        try:
            with Join([joinable]):
                pass
        except RuntimeError as error:
            return str(error)
    return "no error"


def test_a_joinable_cannot_be_in_two_joins_at_once() -> None:
    assert all("already inside another Join" in m for m in run_ranks(_nested, 2))
