"""Join when a rank is interrupted (KeyboardInterrupt, SystemExit) and when it
is given something other than a list of joinables."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import torch.distributed as dist
from counting_joinable import CountingHook, CountingJoinable

from join_core import Join, JoinHook
from join_core.testing import run_ranks

#: How long the failing rank's process lives on after its Join (saving, logging, ...).
LINGER_S = 15.0

CARRIES = pytest.mark.parametrize("carries", [False, True], ids=["heartbeat-allreduce", "heartbeat-carried"])


def _interrupted(rank: int, world_size: int, carries: bool, how: str) -> tuple[str, str, float]:
    # A process started with SIGINT ignored (say, from a background job) has no KeyboardInterrupt handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    joinable = CountingJoinable(carries)
    start = time.monotonic()
    try:
        with Join([joinable]):
            for i in range(6 if rank != 2 else 1):
                if rank == 1 and i == 3:
                    if how == "sigint":
                        signal.raise_signal(signal.SIGINT)  # the handler Python installs: KeyboardInterrupt
                    raise SystemExit(3)
                joinable.step(1.0)
    except BaseException as error:  # noqa: BLE001 - the test reports what each rank saw
        return type(error).__name__, str(error), time.monotonic() - start
    return "none", "", time.monotonic() - start


@CARRIES
@pytest.mark.parametrize("how", ["sigint", "system-exit"])
def test_interrupt_on_one_rank_reaches_every_rank_at_once(carries: bool, how: str) -> None:
    results = run_ranks(_interrupted, 3, carries, how, timeout=60)
    expected = "KeyboardInterrupt" if how == "sigint" else "SystemExit"
    assert results[1][0] == expected  # the interrupted rank keeps its own
    reason = "KeyboardInterrupt" if how == "sigint" else "SystemExit: 3"
    for rank in (0, 2):  # rank 2 had already joined
        kind, message, elapsed = results[rank]
        assert (kind, message) == ("JoinAbortedError", f"Join aborted: rank 1 raised {reason}")
        assert elapsed < 10


class _FailingShadowHook(CountingHook):
    def main_hook(self) -> None:
        if self.joinable.main_hook_calls == 1:
            raise ValueError("shadowing failed")
        super().main_hook()


class _FailsWhileShadowing(CountingJoinable):
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _FailingShadowHook(self, kwargs)


def _fails_alone(rank: int, world_size: int, how: str) -> tuple[str, str, float]:
    """Rank 1 leaves its Join raising what the others are not told by the abort: a DistError
    (torch's, e.g. a store wait of its own that timed out) while training, or any error while
    it shadows (it joined first). Its process then lives on for a while."""
    joinable = CountingJoinable(False) if how == "dist-error" else _FailsWhileShadowing(False)
    start = time.monotonic()
    try:
        with Join([joinable]):
            for i in range(6 if rank != 1 or how == "dist-error" else 1):
                if rank == 1 and i == 3:
                    raise dist.DistStoreError("a store wait of its own timed out")
                joinable.step(1.0)
    except BaseException as error:  # noqa: BLE001 - the test reports what each rank saw
        if rank == 1:
            time.sleep(LINGER_S)
        return type(error).__name__, str(error), time.monotonic() - start
    return "none", "", time.monotonic() - start


@pytest.mark.parametrize("how", ["dist-error", "while-shadowing"])
def test_a_rank_that_leaves_raising_what_the_abort_cannot_tell_is_named_on_every_other_rank(how: str) -> None:
    results = run_ranks(_fails_alone, 3, how, timeout=90)
    reason = (
        "DistStoreError: a store wait of its own timed out"
        if how == "dist-error"
        else "ValueError: shadowing failed"
    )
    assert results[1][:2] == (reason.split(":")[0], reason.split(": ", 1)[1])
    for rank in (0, 2):
        kind, message, elapsed = results[rank]
        assert kind == "RankLostError", results
        assert f"rank 1 (it left the Join raising {reason})" in message, message
        assert elapsed < LINGER_S - 5, results  # not when its process ended


@pytest.mark.parametrize("joinables", [None, 3, "model", iter([])], ids=["none", "int", "str", "iterator"])
def test_joinables_that_are_not_a_list_are_refused_by_name(joinables: object) -> None:
    with pytest.raises(
        TypeError, match=r"^Join\(joinables=.*\): expected a list of Joinables, got \w+; pass them"
    ):
        Join(joinables)  # type: ignore[arg-type]


def test_a_single_joinable_is_told_to_go_in_a_list() -> None:
    with pytest.raises(TypeError, match=r"got CountingJoinable; pass them in a list, e.g. Join\(\[model\]\)"):
        Join(CountingJoinable(False))  # type: ignore[arg-type]
