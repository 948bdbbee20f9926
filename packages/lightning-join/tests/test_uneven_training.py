"""Training with a different number of batches on each rank."""

from __future__ import annotations

from typing import Any

import cases
import pytest
import torch

from join_core.testing import run_ranks

WORLD: int = 3
BASE, EXTRA, EPOCHS = 2, 1, 2  # rank r has BASE + r * EXTRA batches
GATHERED_WEIGHT = 0.25  # of the gathered predictions in a loss


def _fit_uneven(
    rank: int, world_size: int, divide_by_initial_world_size: bool
) -> tuple[dict[str, torch.Tensor], int, float]:
    cases.lightning_env(rank, world_size)
    model = cases.Regression()
    strategy = cases.strategy(divide_by_initial_world_size=divide_by_initial_world_size)
    trainer = cases.trainer(world_size, max_epochs=EPOCHS, strategy=strategy)
    trainer.fit(model, cases.loader(cases.regression_batches(rank, BASE + rank * EXTRA)))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, trainer.global_step, float(trainer.callback_metrics["train_loss_epoch"])


def _reference(divide_by_initial_world_size: bool) -> dict[str, torch.Tensor]:
    """One process, the same steps: step i sums the gradients of the ranks
    that have a batch i, divided by the world size (divide_by_initial_world_size)
    or by the number of those ranks."""
    model = cases.Regression()
    optimizer = model.configure_optimizers()
    shares = [cases.regression_batches(rank, BASE + rank * EXTRA) for rank in range(WORLD)]
    for _ in range(EPOCHS):
        for step in range(max(map(len, shares))):
            optimizer.zero_grad()
            active = [share[step] for share in shares if step < len(share)]
            divisor = WORLD if divide_by_initial_world_size else len(active)
            for x, y in active:
                (torch.nn.functional.mse_loss(model(x), y) / divisor).backward()
            optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_uneven_batches_end_with_the_single_process_model_on_every_rank(
    divide_by_initial_world_size: bool,
) -> None:
    results = run_ranks(_fit_uneven, WORLD, divide_by_initial_world_size, timeout=90)
    expected = _reference(divide_by_initial_world_size)
    steps = EPOCHS * (BASE + (WORLD - 1) * EXTRA)
    for rank, (state, global_step, _) in enumerate(results):
        assert global_step == steps, f"rank {rank}"
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
    # The epoch's mean loss is the same on every rank (synced over every batch of every rank).
    assert len({loss for _, _, loss in results}) == 1


def _fit_throwing(rank: int, world_size: int) -> str:
    cases.lightning_env(rank, world_size)
    trainer = cases.trainer(
        world_size, max_epochs=1, strategy=cases.strategy(throw_on_early_termination=True)
    )
    try:
        trainer.fit(cases.Regression(), cases.loader(cases.regression_batches(rank, BASE + rank * EXTRA)))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_throw_on_early_termination_raises_on_every_rank() -> None:
    messages = run_ranks(_fit_throwing, 2, timeout=90)
    assert "Rank 0 exhausted all inputs" in messages[0]
    assert "Detected at least one rank that exhausted inputs" in messages[1]


class _FailingOnRankOne(cases.Regression):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx == 3:  # rank 0 has joined by then
            raise ValueError("bad batch on rank 1")
        return super().training_step(batch, batch_idx)


def _fit_failing(rank: int, world_size: int) -> str:
    cases.lightning_env(rank, world_size)
    trainer = cases.trainer(world_size, max_epochs=1)
    try:
        trainer.fit(_FailingOnRankOne(), cases.loader(cases.regression_batches(rank, 2 + 3 * rank)))
    except Exception as error:  # noqa: BLE001 - the test reports what each rank raised
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_rank_failing_after_another_joined_stops_every_rank_naming_it() -> None:
    messages = run_ranks(_fit_failing, 2, timeout=90)
    assert messages == [
        "JoinAbortedError: Join aborted: rank 1 raised ValueError: bad batch on rank 1",
        "ValueError: bad batch on rank 1",
    ]


class _Validated(cases.Regression):
    """Counts its validation runs; validation logs a synced loss."""

    def __init__(self) -> None:
        super().__init__()
        self.validations = 0

    def on_validation_start(self) -> None:
        self.validations += 1

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True, batch_size=len(x))


def _fit_to_max_steps(rank: int, world_size: int, longest: int) -> tuple[int, int]:
    cases.lightning_env(rank, world_size)
    model = _Validated()
    trainer = cases.trainer(world_size, max_epochs=1, max_steps=4)
    batches = 3 if rank == 0 else longest
    trainer.fit(
        model,
        cases.loader(cases.regression_batches(rank, batches)),
        cases.loader(cases.regression_batches(9, 2)),
    )
    return trainer.global_step, model.validations


@pytest.mark.parametrize(("longest", "validations"), [(5, 0), (4, 1)])
def test_max_steps_within_an_epoch_validates_on_every_rank_as_the_longest_rank_decides(
    longest: int, validations: int
) -> None:
    # With 5 batches the longest rank stops at step 4 before its last batch, so no rank
    # validates (as with even batches); with 4 it stops at its last batch, so every rank does.
    results = run_ranks(_fit_to_max_steps, 2, longest, timeout=60)
    assert results == [(4, validations)] * 2


def _fit_fp16(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from lightning.pytorch.plugins.precision import MixedPrecision

    cases.lightning_env(rank, world_size)
    # The loss scale doubles at every step without an overflow.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0, growth_interval=1)
    trainer = cases.trainer(world_size, max_epochs=2, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    model = cases.Regression()
    trainer.fit(model, cases.loader(cases.regression_batches(rank, 3 + 2 * rank)))
    return trainer.precision_plugin.state_dict(), {
        k: v.detach().clone() for k, v in model.state_dict().items()
    }


def test_fp16_loss_scale_is_the_longest_ranks_after_an_uneven_epoch() -> None:
    (scale0, model0), (scale1, model1) = run_ranks(_fit_fp16, 2, timeout=60)
    assert scale0 == scale1
    assert scale1["scale"] == 2.0 * 2**10  # 5 steps an epoch
    for key, value in model0.items():
        torch.testing.assert_close(value, model1[key], msg=key)


class _Gathering(cases.Regression):
    """Gathers (its rank, the batch index, a prediction) in every training step, keeping what it got."""

    def __init__(self, sync_grads: bool) -> None:
        super().__init__()
        self.sync_grads = sync_grads
        self.gathered: list[list[list[int]]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        prediction = self.net(x).mean()
        rank_and_index = torch.tensor([float(self.global_rank), float(batch_idx)], device=prediction.device)
        mine = torch.cat([rank_and_index, prediction.unsqueeze(0)])
        gathered = self.all_gather(mine, sync_grads=self.sync_grads)
        assert isinstance(gathered, torch.Tensor)
        self.gathered.append([[int(rank), int(index)] for rank, index, _ in gathered.tolist()])
        # With sync_grads, every rank's loss reaches the predictions of the others.
        return torch.nn.functional.mse_loss(self.net(x), y) + GATHERED_WEIGHT * gathered[:, 2].sum()


def _fit_gathering(
    rank: int, world_size: int, sync_grads: bool
) -> tuple[list[list[list[int]]], dict[str, torch.Tensor]]:
    cases.lightning_env(rank, world_size)
    model = _Gathering(sync_grads)
    trainer = cases.trainer(world_size, max_epochs=1)
    trainer.fit(model, cases.loader(cases.regression_batches(rank, BASE + rank * EXTRA)))
    return model.gathered, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gathering_reference(sync_grads: bool) -> dict[str, torch.Tensor]:
    """One process, the same steps: each rank's loss adds the weighted predictions of the ranks
    with a batch at that step; their gradient flows back through the gather with sync_grads."""
    model = cases.Regression()
    optimizer = model.configure_optimizers()
    shares = [cases.regression_batches(rank, BASE + rank * EXTRA) for rank in range(WORLD)]
    for step in range(max(map(len, shares))):
        optimizer.zero_grad()
        active = [share[step] for share in shares if step < len(share)]
        predictions = [model.net(x).mean() for x, _ in active]
        for (x, y), own in zip(active, predictions):
            reached = sum(predictions) if sync_grads else 0.0 * own  # without: no gradient through it
            (torch.nn.functional.mse_loss(model.net(x), y) + GATHERED_WEIGHT * reached).div(WORLD).backward(
                retain_graph=True
            )
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("sync_grads", [False, True])
def test_all_gather_in_a_training_step_leaves_out_the_ranks_that_have_joined(sync_grads: bool) -> None:
    # Their shadowing zeros came back as rows of rank 0's batch 0.
    results = run_ranks(_fit_gathering, WORLD, sync_grads, timeout=90)
    expected_state = _gathering_reference(sync_grads)
    for rank, (gathered, state) in enumerate(results):
        expected = [
            [[other, index] for other in range(WORLD) if index < BASE + other * EXTRA]
            for index in range(BASE + rank * EXTRA)
        ]
        assert gathered == expected, f"rank {rank}"
        for key, value in expected_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")


def _gradients_through_gathers(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.distributed.nn.functional import all_gather

    from lightning_join._reductions import gather_summing_gradients

    grads = []
    for gather in (lambda t: torch.stack(all_gather(t)), gather_summing_gradients):
        mine = torch.arange(3.0, requires_grad=True)
        weights = torch.arange(world_size * 3.0).reshape(world_size, 3) * (rank + 1)
        (gather(mine * mine) * weights).sum().backward()
        assert mine.grad is not None
        grads.append(mine.grad)
    return grads[0], grads[1]


def test_the_gather_summing_gradients_gives_torchs_gradients() -> None:
    for theirs, ours in run_ranks(_gradients_through_gathers, WORLD):
        torch.testing.assert_close(ours, theirs)
