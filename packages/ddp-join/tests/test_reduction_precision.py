"""The averaging all-reduce in low precision: each rank's float16 gradient is
divided by the world size before the sum, as torch's is, so a sum over the
ranks beyond float16's range (65504) does not turn an in-range average into
infinity."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_join import DistributedDataParallel
from join_core.testing import run_ranks

# Each rank's gradient: in range, while the sum over two ranks or more is not.
GRADIENT = 40000.0


def _large_half_gradients(rank: int, world_size: int, ours: bool, views: bool, steps: int) -> list[float]:
    """Train ``steps`` backwards of a float16 layer whose gradient is GRADIENT on every rank
    (rank 1 of three stops after one step, under a Join for ours); its gradient afterwards."""
    torch.manual_seed(0)
    module = torch.nn.Linear(1, 2, bias=False).half()
    wrapper = DistributedDataParallel if ours else TorchDDP
    model = wrapper(module, gradient_as_bucket_view=views)
    x = torch.full((1, 1), 200.0, dtype=torch.float16)
    if not ours:
        (model(x).sum() * 200).backward()
        assert module.weight.grad is not None
        return [float(g) for g in module.weight.grad.reshape(-1)]
    assert isinstance(model, DistributedDataParallel)
    mine = 1 if rank == 1 else steps
    with model.join(divide_by_initial_world_size=False):
        for _ in range(mine):
            module.weight.grad = None
            (model(x).sum() * 200).backward()
    assert module.weight.grad is not None
    return [float(g) for g in module.weight.grad.reshape(-1)]


@pytest.mark.parametrize("views", [False, True], ids=["copied", "bucket-views"])
def test_float16_gradients_whose_sum_overflows_are_averaged_as_torchs(views: bool) -> None:
    theirs = run_ranks(_large_half_gradients, 2, False, views, 1)
    ours = run_ranks(_large_half_gradients, 2, True, views, 1)
    assert theirs == [[GRADIENT, GRADIENT]] * 2, theirs
    assert ours == theirs


@pytest.mark.parametrize("views", [False, True], ids=["copied", "bucket-views"])
def test_float16_averages_over_the_ranks_still_training_stay_finite(views: bool) -> None:
    """Divided by the world size first, then by the share of it still training: the
    average of the ranks training (here two of three) is the gradient, not infinity."""
    results = run_ranks(_large_half_gradients, 3, True, views, 2)
    for rank in (0, 2):
        assert results[rank] == pytest.approx([GRADIENT, GRADIENT], rel=1e-3), results
