"""A small Joinable for the tests: every iteration all-reduces a value, then
broadcasts rank 0's copy, optionally carrying Join's heartbeat."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from join_core import Join, JoinHook


class CountingJoinable:
    """Two collectives an iteration: an all-reduce (SUM) and a broadcast."""

    def __init__(self, carries_heartbeat: bool) -> None:
        self.carries_heartbeat = carries_heartbeat
        self.sums: list[float] = []  # every reduced value, shadowed iterations included
        self.post_hook_calls: list[bool] = []
        self.main_hook_calls = 0
        self.notify_results: list[dist.Work | None] = []
        self._owes_broadcast = False  # an iteration is between its two collectives

    def step(self, value: float, fail_between_collectives: bool = False) -> None:
        self.notify_results.append(Join.notify_join_context(self))
        total = self._reduce(value)
        self._owes_broadcast = True
        if fail_between_collectives:
            raise ValueError("failed between collectives")
        self._broadcast()
        if self.carries_heartbeat:
            Join.heartbeat_result(self, total)

    def _reduce(self, value: float) -> float:
        buf = torch.tensor([Join.heartbeat_signal(self) if self.carries_heartbeat else 0.0, value])
        dist.all_reduce(buf)
        self.sums.append(float(buf[1]))
        return float(buf[0])

    def _broadcast(self) -> None:
        dist.broadcast(torch.zeros(1), src=0)
        self._owes_broadcast = False

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CountingHook(self, kwargs)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None
        return group


class CountingHook(JoinHook):
    def __init__(self, joinable: CountingJoinable, kwargs: dict[str, Any]) -> None:
        self.joinable = joinable
        self.kwargs = kwargs
        self.carries_heartbeat = joinable.carries_heartbeat

    def main_hook(self) -> None:
        j = self.joinable
        j.main_hook_calls += 1
        total = j._reduce(0.0)
        if j.carries_heartbeat and not Join.heartbeat_result(j, total):
            return
        j._broadcast()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.joinable.post_hook_calls.append(is_last_joiner)

    def abort_hook(self) -> None:
        if self.joinable._owes_broadcast:
            self.joinable._broadcast()
