"""DDP training under Join when a rank dies or freezes mid-iteration: every
surviving rank raises RankLostError naming it within seconds, wherever it was
waiting (a gradient bucket, the sharded optimizer's broadcast)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ddp_cases import batch, loss_fn, make_model

from ddp_join import DistributedDataParallel, ZeroRedundancyOptimizer
from join_core import Join, RankLostError
from join_core.testing import RanksFailedError, run_ranks

#: What the loss of a rank may take to be told, at Join's default liveness timeout.
TOLD_WITHIN_S = 10.0


def _train_and_lose_rank(rank: int, world_size: int, how: str, where: str) -> None:
    pids = torch.zeros(world_size, dtype=torch.int64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    model = DistributedDataParallel(make_model())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    lost = signal.SIGSTOP if how == "freeze" else signal.SIGKILL
    last_progress = time.monotonic()
    try:
        with Join([model, optimizer]):
            for step in range(100_000):
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step % 8))
                if rank == 2 and step == 3 and where == "before-backward":
                    os.kill(os.getpid(), lost)  # the others wait on a gradient bucket
                loss.backward()
                last_progress = time.monotonic()
                if rank == 2 and step == 3 and where == "before-step":
                    os.kill(os.getpid(), lost)  # the others wait on the optimizer's broadcast
                optimizer.step()
                last_progress = time.monotonic()
        raise AssertionError("training ended without noticing the lost rank")
    except RankLostError as error:
        told_after = time.monotonic() - last_progress
        assert list(error.ranks) == [2], str(error)
        assert told_after < TOLD_WITHIN_S, f"told after {told_after:.1f} s"
    finally:
        if rank != 2:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pids[2]), signal.SIGKILL)  # nothing outlives the test


@pytest.mark.parametrize(
    "how,where",
    [("freeze", "before-backward"), ("freeze", "before-step"), ("kill", "before-backward")],
)
def test_surviving_ranks_name_the_lost_rank_within_seconds(how: str, where: str) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_train_and_lose_rank, 3, how, where, timeout=60)
    # Only the lost rank failed: the survivors' own checks passed.
    assert list(failed.value.failures) == [2], str(failed.value)
    assert "exited with code -9" in failed.value.failures[2]


def _join_with_liveness_timeout(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(make_model())
    with pytest.raises(ValueError) as refused:
        model.join(liveness_timeout=timedelta(0))
    return str(refused.value)


def test_model_join_passes_its_liveness_timeout_to_the_join() -> None:
    [message] = run_ranks(_join_with_liveness_timeout, 1)
    assert (
        message == "Join(liveness_timeout=datetime.timedelta(0)): must be positive; pass None to turn it off"
    )


def _join_with_hang_timeout(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(make_model())
    with pytest.raises(ValueError) as refused:
        model.join(hang_timeout=timedelta(0))
    return str(refused.value)


def test_model_join_passes_its_hang_timeout_to_the_join() -> None:
    [message] = run_ranks(_join_with_hang_timeout, 1)
    assert message == "Join(hang_timeout=datetime.timedelta(0)): must be positive; pass None to turn it off"
