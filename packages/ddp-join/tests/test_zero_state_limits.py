"""A member that announces more optimizer state than its share could hold is refused on every
rank before anything that size is allocated."""

from __future__ import annotations

import os

import pytest
import torch
from test_zero_memory import peak_growth_mib

from ddp_join import ZeroRedundancyOptimizer
from join_core.testing import run_ranks

ANNOUNCED = 64 << 20


def _consolidate_announcing_too_much(rank: int, world_size: int) -> tuple[str, float]:
    model = torch.nn.Linear(2, 2)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    if rank == 1:
        import ddp_join.zero

        garbage = bytes(ANNOUNCED)
        setattr(ddp_join.zero, "encode_state", lambda state: garbage)  # noqa: B010 - patched in this rank
    outcome: list[str] = []

    def consolidate() -> None:
        try:
            zero.consolidate_state_dict(to=0)
        except ValueError as exc:
            outcome.append(str(exc))

    growth = peak_growth_mib(consolidate)
    return (outcome[0] if outcome else "no error", growth)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's peak-RSS reset")
def test_oversized_optimizer_state_from_a_member_is_refused_on_every_rank_in_bounded_memory() -> None:
    (error0, growth0), (error1, _) = run_ranks(_consolidate_announcing_too_much, 2, timeout=100)
    for error in (error0, error1):
        assert f"rank 1 of the group announced {ANNOUNCED} bytes" in error, error
        assert "optimizer state" in error
    assert growth0 < 8, f"rank 0 grew by {growth0:.0f} MiB for a refused {ANNOUNCED >> 20} MiB"
