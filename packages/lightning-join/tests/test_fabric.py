"""Fabric loops with a different number of batches on each rank."""

from __future__ import annotations

import re

import cases
import pytest
import torch
from lightning.fabric import Fabric

from join_core.testing import run_ranks
from lightning_join.fabric import JoinDDPStrategy, join

WORLD: int = 2
BASE, EXTRA = 2, 2  # rank r has BASE + r * EXTRA batches


def _train(rank: int, world_size: int) -> tuple[dict[str, torch.Tensor], float]:
    cases.lightning_env(rank, world_size)
    strategy = cases.DDPStrategyFabric() if cases.BASELINE else JoinDDPStrategy()
    fabric = Fabric(**cases.placement(world_size), strategy=strategy)
    fabric.launch()
    module = cases.Regression()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    losses = []
    with join(fabric) if not cases.BASELINE else torch.enable_grad():
        for x, y in cases.regression_batches(rank, BASE + rank * EXTRA):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(fabric.device)), y.to(fabric.device))
            fabric.backward(loss)
            optimizer.step()
            reduced = fabric.all_reduce(loss.detach(), reduce_op="mean")
            assert isinstance(reduced, torch.Tensor)
            losses.append(reduced)
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}, float(losses[-1])


def _reference() -> tuple[dict[str, torch.Tensor], float]:
    model = cases.Regression()
    optimizer = model.configure_optimizers()
    shares = [cases.regression_batches(rank, BASE + rank * EXTRA) for rank in range(WORLD)]
    last_losses: list[float] = []
    for step in range(max(map(len, shares))):
        optimizer.zero_grad()
        last_losses = []
        for share in shares:
            if step < len(share):
                x, y = share[step]
                loss = torch.nn.functional.mse_loss(model(x), y)
                (loss / WORLD).backward()
                last_losses.append(float(loss.detach()))
        optimizer.step()
    return model.state_dict(), sum(last_losses) / len(last_losses)


def test_fabric_loop_under_join_ends_with_the_single_process_model() -> None:
    results = run_ranks(_train, WORLD, timeout=60)
    expected, last_loss = _reference()
    for rank, (state, _) in enumerate(results):
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
    # The last step's loss, averaged over the ranks that had a batch: the joined rank is left out.
    assert results[-1][1] == pytest.approx(last_loss, rel=1e-5)


def _gather_in_the_loop(rank: int, world_size: int) -> list[list[int]]:
    cases.lightning_env(rank, world_size)
    fabric = Fabric(**cases.placement(world_size), strategy=JoinDDPStrategy())
    fabric.launch()
    module = cases.Regression()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    gathered = []
    with join(fabric):
        for step, (x, y) in enumerate(cases.regression_batches(rank, BASE + rank * EXTRA)):
            optimizer.zero_grad()
            fabric.backward(torch.nn.functional.mse_loss(model(x.to(fabric.device)), y.to(fabric.device)))
            optimizer.step()
            rows = fabric.all_gather(torch.tensor([rank, step], device=fabric.device))
            assert isinstance(rows, torch.Tensor)
            gathered.append([int(r) for r, _ in rows.tolist()])
    return gathered


def test_all_gather_in_the_loop_leaves_out_the_ranks_that_have_joined() -> None:
    # Rank 0's shadowing zeros came back as a row of rank 0's step 0.
    shortest, longest = run_ranks(_gather_in_the_loop, WORLD, timeout=60)
    assert shortest == [[0, 1]] * BASE
    assert longest == [[0, 1]] * BASE + [[1]] * EXTRA


def test_join_needs_the_join_strategy() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(TypeError, match=re.escape("strategy=lightning_join.fabric.JoinDDPStrategy()")):
        join(fabric)
