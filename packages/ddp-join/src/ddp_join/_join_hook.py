"""The Join hook of DistributedDataParallel: what a joined rank issues so that
every collective of the ranks still training finds its match."""

from __future__ import annotations

from typing import Protocol

from ddp_join._reducer import Reducer
from join_core import Join, JoinHook, Recovery


class Replica(Protocol):
    """What the hook needs of the module wrapper, besides its reducer."""

    def will_sync_module_buffers(self) -> bool:
        """Whether a synchronizing forward broadcasts the module's buffers."""
        ...

    def _sync_buffers(self) -> None: ...

    def _take_last_joiners_model(self, is_last_joiner: bool) -> None: ...


class DDPJoinHook(JoinHook):
    """Shadows one DistributedDataParallel iteration on a joined rank: the
    buffer broadcast, then every bucket (zeros) through the same reduction."""

    regroup_phases = 2  # the buffer broadcast, then the gradient reduction

    def __init__(self, replica: Replica, reducer: Reducer) -> None:
        self.replica = replica
        self.reducer = reducer

    @property
    def carries_heartbeat(self) -> bool:  # type: ignore[override]
        return self.reducer.carries

    def main_hook(self) -> None:
        self.reducer.reset_iteration()
        if self.replica.will_sync_module_buffers():
            self.replica._sync_buffers()
        self.reducer.reduce_zeros()

    def enter_hook(self) -> None:
        self.reducer.enter_join()
        self.reducer.keep_copies(Join.continues_on_loss(self.reducer.joinable))

    def exit_hook(self) -> None:
        self.reducer.keep_copies(False)

    def regroup_hook(self, recovery: Recovery, first_phase: int) -> None:
        self.reducer.regroup(recovery, first_phase)

    def abort_hook(self) -> None:
        self.reducer.abort()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.replica._take_last_joiners_model(is_last_joiner)
