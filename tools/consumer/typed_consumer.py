"""A downstream user's code: every public name used as documented, its types
asserted. Checked by mypy --strict against the installed wheels."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import assert_type

import join_core
from join_core import Join, JoinAbortedError, JoinHook, Joinable
from join_core.testing import RanksFailedError, run_ranks


class CounterHook(JoinHook):
    def main_hook(self) -> None:
        dist.all_reduce(torch.zeros(1))

    def post_hook(self, is_last_joiner: bool) -> None:
        assert_type(is_last_joiner, bool)


class Counter:
    """A structural Joinable: no base class needed."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None
        return group


class ExplicitCounter(Joinable):
    """An explicit subclass of the Protocol."""

    def __init__(self) -> None:
        super().__init__()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None
        return group


def train(rank: int, world_size: int) -> int:
    counter = Counter()
    joinables: list[Joinable] = [counter, ExplicitCounter()]
    with Join(joinables, enable=True, throw_on_early_termination=False, any_hook_option=1) as join:
        assert_type(join, Join)
        for _ in range(rank + 1):
            assert_type(Join.notify_join_context(counter), dist.Work | None)
            slot = torch.tensor([Join.heartbeat_signal(counter)])
            dist.all_reduce(slot)
            assert_type(Join.heartbeat_result(counter, float(slot)), bool)
    return rank


def main() -> None:
    try:
        ranks = run_ranks(train, 2, timeout=60.0)
        assert_type(ranks, list[int])
    except RanksFailedError as error:
        assert_type(error.failures, dict[int, str])
    except JoinAbortedError as aborted:
        assert_type(aborted.failures, dict[int, str])
    assert_type(JoinHook().carries_heartbeat, bool)
    assert_type(join_core.__all__, list[str])


if __name__ == "__main__":
    main()
