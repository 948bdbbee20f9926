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
    """sharded.ShardedRegression, its optimizer stepped in training_step, and
    its scheduler (multiplying the learning rate by 0.8) stepped after every
    step (``schedule="step"``, configured with interval "step"), in
    on_train_epoch_end (``"epoch"``), or on the epoch's last batch
    (``"last batch"``, as Lightning's documentation shows); its gradients
    clipped to a norm of ``clip`` with ``self.clip_gradients()``, if given."""

    def __init__(self, schedule: str = "step", clip: float | None = None) -> None:
        super().__init__("step" if schedule == "step" else "epoch")
        self.automatic_optimization = False
        self.schedule = schedule
        self.clip = clip

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = _optimizer(self)
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if self.clip is not None:
            self.clip_gradients(
                optimizer.optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm"
            )
        optimizer.step()
        optimizer.zero_grad()
        if self.schedule == "step" or (self.schedule == "last batch" and self.trainer.is_last_batch):
            self._scheduler().step()
        return loss

    def on_train_epoch_end(self) -> None:
        if self.schedule == "epoch":
            self._scheduler().step()

    def _scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        scheduler = self.lr_schedulers()
        assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
        return scheduler


def _fit(
    rank: int, world_size: int, schedule: str | None, clip: float | None
) -> tuple[dict[str, torch.Tensor], int]:
    """Fit ManualRegression with JoinDDPStrategy (``schedule`` None), or
    ManualShardedRegression(schedule, clip) with JoinFSDPStrategy."""
    cases.lightning_env(rank, world_size)
    strategy = JoinDDPStrategy() if schedule is None else JoinFSDPStrategy()
    trainer = cases.trainer(world_size, max_epochs=EPOCHS, strategy=strategy)
    model = ManualRegression() if schedule is None else ManualShardedRegression(schedule, clip)
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
@pytest.mark.parametrize(
    ("schedule", "clip"),
    [(None, None), ("step", None), ("epoch", None), ("step", 0.3)],
    ids=["ddp", "fsdp-step", "fsdp-epoch", "fsdp-step-clipped"],
)
def test_manual_optimization_ends_with_the_single_process_model_on_every_rank(
    schedule: str | None, clip: float | None
) -> None:
    results = run_ranks(_fit, WORLD, schedule, clip, timeout=150)
    if schedule is None:
        expected = _regression_reference()
    else:
        expected = sharded.reference(COUNTS, EPOCHS, True, schedule, None if clip is None else (clip, "norm"))
    for rank, (state, global_step) in enumerate(results):
        assert global_step == EPOCHS * max(COUNTS), f"rank {rank}"
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")


class _ManualWithUnused(ManualRegression):
    """ManualRegression with a layer its loss never reaches, and AdamW with weight decay."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(2, 2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.5)


def _fit_with_unused(rank: int, world_size: int, ours: bool) -> tuple[bool, list[float]]:
    from lightning.pytorch.strategies import DDPStrategy

    cases.lightning_env(rank, world_size)
    strategy = (
        JoinDDPStrategy(find_unused_parameters=True) if ours else DDPStrategy(find_unused_parameters=True)
    )
    trainer = cases.trainer(world_size, max_epochs=1, strategy=strategy)
    model = _ManualWithUnused()
    before = model.unused.weight.detach().clone()
    trainer.fit(model, cases.loader(cases.regression_batches(rank, 2)))
    moved = (model.unused.weight.detach() - before).abs().reshape(-1).tolist()
    return model.unused.weight.grad is None, moved


def test_manual_optimization_leaves_the_parameters_its_loss_never_reaches_alone_as_ddpstrategy() -> None:
    # The backward ran inside the wrapper's forward, before it looked for unused parameters:
    # they got zero gradients, which AdamW's weight decay then applied.
    theirs = run_ranks(_fit_with_unused, 2, False, timeout=150)
    ours = run_ranks(_fit_with_unused, 2, True, timeout=150)
    assert theirs[0] == (True, [0.0] * 4)
    assert ours == theirs


def _fit_scheduled_on_last_batch(rank: int, world_size: int) -> str:
    cases.lightning_env(rank, world_size)
    trainer = cases.trainer(world_size, max_epochs=1, strategy=JoinFSDPStrategy())
    try:
        trainer.fit(
            ManualShardedRegression("last batch"), cases.loader(cases.regression_batches(rank, COUNTS[rank]))
        )
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
def test_a_shard_stepped_with_another_learning_rate_stops_every_rank_naming_the_fix() -> None:
    # Rank 0 steps the scheduler after its last batch, batch 1, then replays
    # batches 2 and 3 of the others with the next epoch's learning rate.
    messages = run_ranks(_fit_scheduled_on_last_batch, WORLD, timeout=90)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith(
        "JoinFSDPStrategy: rank 0 stepped its shard at batch 2 of epoch 0 with learning rate 0.08 where "
        "rank 2, still training, used 0.1 (rank 1 too), so the model is no longer"
    ), messages[0]
    assert "or after the epoch (in on_train_epoch_end, not on trainer.is_last_batch" in messages[0]


FAULT_AT: int = 3  # the last batch of rank 2, the others have joined by then


class _DDPFault(ManualRegression):
    """At batch FAULT_AT, two backward passes (``"two backwards"``) or none."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx != FAULT_AT:
            return super().training_step(batch, batch_idx)
        optimizer = _optimizer(self)
        loss = cases.Regression.training_step(self, batch, batch_idx)
        if self.fault == "two backwards":
            x, y = batch
            self.manual_backward(loss)
            self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y))
        optimizer.step()
        optimizer.zero_grad()
        return loss


class _FSDPFault(ManualShardedRegression):
    """At batch FAULT_AT, two optimizer steps (``"two steps"``) or none."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx != FAULT_AT:
            return super().training_step(batch, batch_idx)
        optimizer = _optimizer(self)
        loss = sharded.ShardedRegression.training_step(self, batch, batch_idx)
        self.manual_backward(loss)
        for _ in range(2 if self.fault == "two steps" else 0):
            optimizer.step()
        optimizer.zero_grad()
        return loss


def _fit_faulty(rank: int, world_size: int, fault: str) -> str:
    cases.lightning_env(rank, world_size)
    fsdp = fault in ("two steps", "no step")
    strategy = JoinFSDPStrategy() if fsdp else JoinDDPStrategy()
    trainer = cases.trainer(world_size, max_epochs=1, strategy=strategy)
    model = _FSDPFault(fault) if fsdp else _DDPFault(fault)
    try:
        trainer.fit(model, cases.loader(cases.regression_batches(rank, COUNTS[rank])))
    except Exception as error:  # noqa: BLE001 - the test reports what each rank raised
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "named"),
    [
        (
            "two backwards",
            "JoinDDPStrategy: with manual optimization (automatic_optimization=False), "
            "every training_step must call self.manual_backward() once; this one called it 2 times: "
            "a rank out of batches shadows one gradient all-reduce",
        ),
        (
            "no backward",
            "every training_step must call self.manual_backward() once; this one called it 0 times",
        ),
        (
            "two steps",
            "JoinFSDPStrategy: with manual optimization (automatic_optimization=False), every "
            "training_step must call the optimizer's step() once; this one called it 2 times: a rank out of "
            "batches replays one forward, backward and optimizer step",
        ),
        ("no step", "every training_step must call the optimizer's step() once; this one called it 0 times"),
    ],
)
def test_a_manual_training_step_a_joined_rank_cannot_shadow_stops_every_rank_naming_the_fix(
    fault: str, named: str
) -> None:
    messages = run_ranks(_fit_faulty, WORLD, fault, timeout=90)
    assert messages[2].startswith("ValueError: ") and named in messages[2], messages[2]
    for rank in (0, 1):
        assert messages[rank].startswith("JoinAbortedError: Join aborted: rank 2 raised ValueError: "), (
            messages[rank]
        )
