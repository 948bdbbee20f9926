"""JoinFSDPStrategy: FSDP2 training with a different number of batches on each rank."""

from __future__ import annotations

from typing import Any

import cases
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from sharded import ShardedRegression, full_state, net, reference
from torch.distributed.fsdp import fully_shard

from join_core.testing import RanksFailedError, run_ranks
from lightning_join import JoinFSDPStrategy

WORLD: int = 3
BASE, EXTRA, EPOCHS = 2, 1, 2  # rank r has BASE + r * EXTRA batches
COUNTS: tuple[int, ...] = tuple(BASE + rank * EXTRA for rank in range(WORLD))


def _fit(
    rank: int, world_size: int, baseline: bool, divide: bool, interval: str = "step"
) -> tuple[dict[str, torch.Tensor], int, float]:
    cases.lightning_env(rank, world_size)
    model = ShardedRegression(interval)
    strategy = (
        ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
        if baseline
        else JoinFSDPStrategy(divide_by_initial_world_size=divide)
    )
    trainer = cases.trainer(world_size, max_epochs=EPOCHS, strategy=strategy)
    trainer.fit(model, cases.loader(cases.regression_batches(rank, BASE + rank * EXTRA)))
    return full_state(model.net), trainer.global_step, float(trainer.callback_metrics["train_loss_epoch"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("divide_by_initial_world_size", "interval"), [(True, "step"), (False, "step"), (True, "epoch")]
)
def test_uneven_batches_end_with_the_single_process_model_on_every_rank(
    divide_by_initial_world_size: bool, interval: str
) -> None:
    results = run_ranks(_fit, WORLD, False, divide_by_initial_world_size, interval, timeout=150)
    expected = reference(COUNTS, EPOCHS, divide_by_initial_world_size, interval)
    steps = EPOCHS * (BASE + (WORLD - 1) * EXTRA)
    for rank, (state, global_step, _) in enumerate(results):
        assert global_step == steps, f"rank {rank}"
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
            assert torch.equal(state[key], results[0][0][key]), f"rank {rank}: {key}"
    # The epoch's mean loss is the same on every rank (synced over every batch of every rank).
    assert len({loss for _, _, loss in results}) == 1


@pytest.mark.timeout(120)
@pytest.mark.slow(reason="shows Lightning's own strategy hanging: the hang is waited out for 45 s")
def test_model_parallel_strategy_hangs_on_the_same_uneven_batches() -> None:
    with pytest.raises(RanksFailedError, match="no result within"):
        run_ranks(_fit, 2, True, True, timeout=45)


def _fit_clipped(rank: int, world_size: int, clip_val: float, algorithm: str) -> dict[str, torch.Tensor]:
    cases.lightning_env(rank, world_size)
    model = ShardedRegression()
    trainer = cases.trainer(
        world_size,
        max_epochs=EPOCHS,
        strategy=JoinFSDPStrategy(),
        gradient_clip_val=clip_val,
        gradient_clip_algorithm=algorithm,
    )
    trainer.fit(model, cases.loader(cases.regression_batches(rank, BASE + rank * EXTRA)))
    return full_state(model.net)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("clip_val", "algorithm"), [(0.3, "norm"), (0.05, "value")])
def test_clipped_gradients_end_with_the_single_process_model_on_every_rank(
    clip_val: float, algorithm: str
) -> None:
    # Every step clips: the averaged gradient's norm stays above 0.3, and some of its
    # elements above 0.05. A joined rank clips its shard of it too, counted in the norm.
    results = run_ranks(_fit_clipped, WORLD, clip_val, algorithm, timeout=150)
    expected = reference(COUNTS, EPOCHS, clip=(clip_val, algorithm))
    unclipped = reference(COUNTS, EPOCHS)
    assert any(not torch.allclose(expected[key], unclipped[key], rtol=1e-3) for key in expected)
    for rank, state in enumerate(results):
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
            assert torch.equal(state[key], results[0][key]), f"rank {rank}: {key}"


SAMPLES, BATCH = 25, 4  # exact_eval shares of 9, 8 and 8 samples: 3, 2 and 2 batches


def _validation_data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, cases.FEATURES, generator=generator)
    return torch.utils.data.TensorDataset(x, torch.randn(SAMPLES, 1, generator=generator))


def _fit_and_validate(
    rank: int, world_size: int, stage: str
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    cases.lightning_env(rank, world_size)
    model = ShardedRegression()
    trainer = cases.trainer(world_size, max_epochs=1, strategy=JoinFSDPStrategy(exact_eval=True))
    val = torch.utils.data.DataLoader(_validation_data(), batch_size=BATCH)
    if stage == "fit":  # validation after an epoch of uneven training
        trainer.fit(model, cases.loader(cases.regression_batches(rank, BASE + rank * EXTRA)), val)
    else:
        trainer.validate(model, val, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    return metrics, full_state(model.net)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_exact_validation_equals_the_single_process_values(stage: str) -> None:
    results = run_ranks(_fit_and_validate, WORLD, stage, timeout=150)
    model = net()
    model.load_state_dict(results[0][1])
    x, y = _validation_data().tensors
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(model(x), y))
    for rank, (metrics, _) in enumerate(results):
        assert metrics["val_count"] == SAMPLES, f"rank {rank}"
        assert metrics["val_loss"] == pytest.approx(expected, rel=1e-5), f"rank {rank}"


def _fit_throwing(rank: int, world_size: int) -> str:
    cases.lightning_env(rank, world_size)
    trainer = cases.trainer(
        world_size, max_epochs=1, strategy=JoinFSDPStrategy(throw_on_early_termination=True)
    )
    try:
        trainer.fit(ShardedRegression(), cases.loader(cases.regression_batches(rank, BASE + rank * EXTRA)))
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
def test_throw_on_early_termination_raises_on_every_rank() -> None:
    messages = run_ranks(_fit_throwing, 2, timeout=90)
    assert "Rank 0 exhausted all inputs" in messages[0]
    assert "Detected at least one rank that exhausted inputs" in messages[1]


class _TwoRoots(ShardedRegression):
    def configure_model(self) -> None:
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.device_mesh)


def _fit_refused(rank: int, world_size: int, setting: str) -> str:
    cases.lightning_env(rank, world_size)
    options: dict[str, Any] = {}
    model = ShardedRegression()
    strategy = JoinFSDPStrategy()
    if setting == "data_parallel_size":
        strategy = JoinFSDPStrategy(data_parallel_size=1)
    elif setting == "roots":
        model = _TwoRoots()
    elif setting == "every_n_train_steps":
        options = {"callbacks": [ModelCheckpoint(every_n_train_steps=2)], "enable_checkpointing": True}
    else:
        options = {setting: 2}
    trainer = cases.trainer(world_size, max_epochs=1, strategy=strategy, **options)
    try:
        trainer.fit(model, cases.loader(cases.regression_batches(rank, 2)))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("data_parallel_size", "set data_parallel_size=2 (the world size) and tensor_parallel_size=1"),
        ("roots", "has 2 outermost modules sharded with fully_shard (net.0, net.2)"),
        ("accumulate_grad_batches", "use accumulate_grad_batches=1"),
        ("every_n_train_steps", "ModelCheckpoint(every_n_train_steps=2) saves in the middle of an epoch"),
    ],
)
def test_settings_a_joined_rank_cannot_replay_are_refused_naming_the_fix(setting: str, named: str) -> None:
    messages = run_ranks(_fit_refused, 2, setting, timeout=90)
    assert all(named in message for message in messages), messages


def test_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2\): tensor parallelism is not supported"):
        JoinFSDPStrategy(tensor_parallel_size=2)


class _FailingOnRankOne(ShardedRegression):
    def __init__(self, after_forward: bool) -> None:
        super().__init__()
        self.after_forward = after_forward

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        failing = self.global_rank == 1 and batch_idx == 3  # rank 0 has joined by then
        if failing and not self.after_forward:
            raise ValueError("bad batch on rank 1")
        loss = super().training_step(batch, batch_idx)
        if failing:  # between the forward and its backward: the others wait in its collectives
            raise ValueError("bad batch on rank 1")
        return loss


def _fit_failing(rank: int, world_size: int, after_forward: bool) -> str:
    cases.lightning_env(rank, world_size)
    trainer = cases.trainer(world_size, max_epochs=1, strategy=JoinFSDPStrategy())
    try:
        trainer.fit(
            _FailingOnRankOne(after_forward), cases.loader(cases.regression_batches(rank, 2 + 3 * rank))
        )
    except Exception as error:  # noqa: BLE001 - the test reports what each rank raised
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_forward", [False, True])
def test_a_rank_failing_after_another_joined_stops_every_rank_naming_it(after_forward: bool) -> None:
    messages = run_ranks(_fit_failing, 2, after_forward, timeout=90)
    assert messages == [
        "JoinAbortedError: Join aborted: rank 1 raised ValueError: bad batch on rank 1",
        "ValueError: bad batch on rank 1",
    ]
