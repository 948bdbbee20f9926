"""Manual optimization (``automatic_optimization = False``) with uneven batches per rank."""

from __future__ import annotations

from typing import Any

import cases
import pytest
import sharded
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from join_core.testing import run_ranks
from lightning_join import JoinDDPStrategy, JoinFSDPStrategy

WORLD: int = 3
COUNTS: tuple[int, ...] = (2, 3, 4)  # training batches of each rank
EPOCHS: int = 2


def _optimizer(module: Any) -> LightningOptimizer:
    optimizer = module.optimizers()
    assert isinstance(optimizer, LightningOptimizer)
    return optimizer


class ManualRegression(cases.Regression):
    """cases.Regression, its optimizer stepped in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = _optimizer(self)
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss


class ManualShardedRegression(sharded.ShardedRegression):
    """sharded.ShardedRegression, its optimizer and step-interval scheduler
    stepped in training_step."""

    def __init__(self) -> None:
        super().__init__("step")
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = _optimizer(self)
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler = self.lr_schedulers()
        assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
        scheduler.step()
        return loss


def _fit(rank: int, world_size: int, fsdp: bool) -> tuple[dict[str, torch.Tensor], int]:
    cases.lightning_env(rank, world_size)
    strategy = JoinFSDPStrategy() if fsdp else JoinDDPStrategy()
    trainer = cases.trainer(world_size, max_epochs=EPOCHS, strategy=strategy)
    model = ManualShardedRegression() if fsdp else ManualRegression()
    trainer.fit(model, cases.loader(cases.regression_batches(rank, COUNTS[rank])))
    if isinstance(model, ManualShardedRegression):
        return sharded.full_state(model.net), trainer.global_step
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}, trainer.global_step


def _regression_reference() -> dict[str, torch.Tensor]:
    """cases.Regression trained in one process: step i sums the gradients of
    the ranks that have a batch i, divided by the world size."""
    model = cases.Regression()
    optimizer = model.configure_optimizers()
    shares = [cases.regression_batches(rank, count) for rank, count in enumerate(COUNTS)]
    for _ in range(EPOCHS):
        for step in range(max(COUNTS)):
            optimizer.zero_grad()
            for x, y in [share[step] for share in shares if step < len(share)]:
                (torch.nn.functional.mse_loss(model(x), y) / WORLD).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.net.state_dict().items()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_manual_optimization_ends_with_the_single_process_model_on_every_rank(fsdp: bool) -> None:
    results = run_ranks(_fit, WORLD, fsdp, timeout=150)
    expected = sharded.reference(COUNTS, EPOCHS) if fsdp else _regression_reference()
    for rank, (state, global_step) in enumerate(results):
        assert global_step == EPOCHS * max(COUNTS), f"rank {rank}"
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
