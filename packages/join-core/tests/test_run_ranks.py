"""run_ranks tells how each rank that gave no result ended."""

from __future__ import annotations

import os

import pytest

from join_core.testing import RanksFailedError, run_ranks


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_a_rank_that_exits_without_a_result_is_told_by_its_exit_code() -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_exit_on_rank_one, 2, timeout=60)
    assert failed.value.failures == {1: "exited with code 3 before reporting a result"}
