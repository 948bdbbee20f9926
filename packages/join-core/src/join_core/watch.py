"""Hang reports, desync errors and lost ranks for scripts without a Join."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from join_core.collective_watch import DEFAULT_HANG_TIMEOUT
from join_core.exit_grace import install_exit_grace
from join_core.liveness import DEFAULT_LIVENESS_TIMEOUT, LivenessWatchdog, check_watch_timeouts

__all__ = ["CollectiveWatchHandle", "watch_collectives"]


class CollectiveWatchHandle:
    """A running :func:`watch_collectives`; :meth:`stop` ends it (it also ends
    with the main thread)."""

    def __init__(self, watchdog: LivenessWatchdog) -> None:
        self._watchdog = watchdog

    def stop(self) -> None:
        """Stop watching; the other ranks then no longer watch this one."""
        self._watchdog.stop()

    def failure(self) -> BaseException | None:
        """The verdict reached so far (RankLostError, CollectiveDesyncError), or None."""
        return self._watchdog.failure()


def watch_collectives(
    group: dist.ProcessGroup | None = None,
    *,
    liveness_timeout: timedelta = DEFAULT_LIVENESS_TIMEOUT,
    hang_timeout: timedelta | None = DEFAULT_HANG_TIMEOUT,
) -> CollectiveWatchHandle:
    """Record this process's collectives and watch ``group`` (default: the
    world) as a Join does: a rank that dies or freezes, ranks whose
    collectives go out of step, a collective that waits too long.

    Call it on every rank after ``init_process_group``, at the same point;
    it issues no collective. A collective on the group then raises
    ``RankLostError`` or ``CollectiveDesyncError`` instead of hanging, and
    a hang is reported in the log and in a dump, as under ``Join``::

        dist.init_process_group("gloo")
        join_core.watch_collectives()

    Args:
        group: the process group to watch.
        liveness_timeout: how long a rank may go without a heartbeat.
        hang_timeout: the least wait reported as a hang; None: no reports.
    """
    check_watch_timeouts("watch_collectives", liveness_timeout, hang_timeout, liveness_off_allowed=False)
    if not dist.is_initialized():
        raise RuntimeError(
            "watch_collectives(): the default process group is not initialized; "
            "call torch.distributed.init_process_group() first"
        )
    chosen = group if group is not None else dist.group.WORLD
    assert chosen is not None
    watchdog = LivenessWatchdog(
        chosen,
        liveness_timeout,
        hang_timeout,
        prefix=f"join_core/watch/{chosen.group_name}/",
        until_main_thread_ends=True,
    )
    install_exit_grace()
    if dist.get_world_size(chosen) > 1:
        watchdog.start()
    return CollectiveWatchHandle(watchdog)
