"""Join(on_rank_lost="continue"): when a rank dies, freezes or is cut off,
the others go on with DDP and end exactly where a single process applying,
at each iteration, the gradients of the ranks active then would end."""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ddp_cases import batch, flat_params, loss_fn, make_model, reference

from ddp_join import DistributedDataParallel
from join_core import Join, RankRemovedError
from join_core.testing import RanksFailedError, run_ranks

LIVENESS = timedelta(seconds=2)
STEPS = 8
LOST_AT = 3  # the iteration (from 0) in which rank 2 is lost
TINY_BUCKETS_MB = 1e-6  # a bucket per parameter: a loss can fall between two buckets' reductions


def _pids(rank: int, world_size: int) -> list[int]:
    pids = torch.zeros(world_size, dtype=torch.int64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    return [int(pid) for pid in pids]


def _lose_rank_2(rank: int, world_size: int, how: str, where: str) -> str:
    """Train STEPS iterations; rank 2 is lost in iteration LOST_AT at ``where``.
    Survivors check their parameters against the reference and the Join's record."""
    pids = _pids(rank, world_size)
    model = DistributedDataParallel(make_model(), bucket_cap_mb=TINY_BUCKETS_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lose = signal.SIGSTOP if how == "freeze" else signal.SIGKILL

    def lose_here(spot: str, step: int) -> None:
        if rank == 2 and step == LOST_AT and where == spot:
            os.kill(os.getpid(), lose)

    current = [0]

    def lose_between_buckets(grad: torch.Tensor) -> torch.Tensor:
        lose_here("between-buckets", current[0])
        return grad

    # The first parameter's gradient comes last in backward: later buckets are reduced by then.
    next(model.module.parameters()).register_hook(lose_between_buckets)
    try:
        with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS) as join:
            for step in range(STEPS):
                current[0] = step
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step))
                lose_here("forward", step)
                loss.backward()
                lose_here("step", step)
                optimizer.step()
    except RankRemovedError as removed:
        assert rank == 2, str(removed)
        assert removed.iteration == LOST_AT + 1, str(removed)  # counted from 1
        return "removed"
    finally:
        if rank == 0 and how == "freeze":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[2], signal.SIGCONT)  # it wakes up: it must be fenced
    assert rank != 2, "the lost rank went on"
    assert list(join.lost_ranks) == [2], join.lost_ranks
    # Found in the iteration of its loss, or (lost after its reduction) the next one; counted from 1.
    removed_in = LOST_AT + 2 if where == "step" else LOST_AT + 1
    assert f"removed at iteration {removed_in}" in join.lost_ranks[2], join.lost_ranks
    assert dist.get_world_size(join.process_group) == 2
    # Its gradients count through the last iteration whose reduction it completed.
    through = LOST_AT if where == "step" else LOST_AT - 1
    expected = reference([STEPS, STEPS, through + 1], lambda p: torch.optim.SGD(p, lr=0.1))
    torch.testing.assert_close(flat_params(model.module), expected, rtol=1e-5, atol=1e-6)
    return "survived"


@pytest.mark.parametrize("where", ["forward", "between-buckets", "step"])
def test_survivors_of_a_killed_rank_finish_exactly(where: str) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_lose_rank_2, 3, "kill", where, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)  # the survivors' checks passed
    assert "exited with code -9" in failed.value.failures[2]


def test_survivors_of_a_frozen_rank_finish_exactly_and_fence_it_when_it_wakes() -> None:
    assert run_ranks(_lose_rank_2, 3, "freeze", "forward", timeout=90) == ["survived", "survived", "removed"]
