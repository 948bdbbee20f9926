"""Settings that cannot work with uneven batches are refused, naming the fix."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import cases
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from torch.utils.data import DataLoader

from join_core.testing import run_ranks
from lightning_join import JoinDDPStrategy, JoinFSDPStrategy
from lightning_join.fabric import JoinDDPStrategy as FabricJoinDDPStrategy


def _fit_refused(rank: int, world_size: int, setting: str) -> str:
    cases.lightning_env(rank, world_size)
    options: dict[str, Any] = {"enable_checkpointing": True}
    if setting == "sampler":
        options["use_distributed_sampler"] = True
    elif setting == "interval":
        options["val_check_interval"] = 0.5
    elif setting == "interval_time":
        options["val_check_interval"] = "00:00:10:00"
    elif setting == "max_time":
        options["max_time"] = {"minutes": 5}
    elif setting == "timer_step":
        options["callbacks"] = [Timer(duration=timedelta(minutes=5), interval="step")]
    elif setting == "accumulate":
        options["accumulate_grad_batches"] = 2
    elif setting == "checkpoint_steps":
        options["callbacks"] = [ModelCheckpoint(every_n_train_steps=2)]
    else:
        options["callbacks"] = [ModelCheckpoint(train_time_interval=timedelta(minutes=5))]
    trainer = cases.trainer(world_size, max_epochs=1, strategy=JoinDDPStrategy(), **options)
    try:
        trainer.fit(cases.Regression(), cases.loader(cases.regression_batches(rank, 4)))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("sampler", "JoinDDPStrategy needs Trainer(use_distributed_sampler=False)"),
        ("interval", "Trainer(val_check_interval=0.5) validates in the middle of an epoch"),
        ("interval_time", "a time-based Trainer(val_check_interval=...) (600 s) validates when"),
        ("max_time", "Timer(interval='step') (the one Trainer(max_time=...) adds) broadcasts"),
        ("timer_step", "callbacks=[Timer(duration=..., interval='epoch')] instead of max_time"),
        ("accumulate", "Trainer(accumulate_grad_batches=2) is not supported"),
        ("checkpoint_steps", "ModelCheckpoint(every_n_train_steps=2) saves in the middle of an epoch"),
        (
            "checkpoint_time",
            "ModelCheckpoint(train_time_interval=datetime.timedelta(seconds=300)) saves in the middle",
        ),
    ],
)
def test_trainer_settings_that_cannot_work_with_uneven_batches_are_refused(setting: str, named: str) -> None:
    (message,) = run_ranks(_fit_refused, 1, setting, timeout=60)
    assert named in message


def test_strategy_arguments_it_cannot_honour_are_refused() -> None:
    with pytest.raises(ValueError, match=r"ddp_comm_wrapper=.*not supported"):
        JoinDDPStrategy(ddp_comm_wrapper=lambda hook: hook)
    with pytest.raises(ValueError, match=r"model_averaging_period=4\): post-local SGD"):
        JoinDDPStrategy(model_averaging_period=4)


def test_a_liveness_timeout_that_is_not_a_positive_timedelta_is_refused_by_every_strategy() -> None:
    # At construction, in the launching process: not at the first Join in every launched rank.
    for strategy in (JoinDDPStrategy, JoinFSDPStrategy, FabricJoinDDPStrategy):
        with pytest.raises(
            TypeError, match=rf"{strategy.__name__}\(liveness_timeout=30.0\): must be a datetime.timedelta"
        ):
            strategy(liveness_timeout=30.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"liveness_timeout=.*must be positive"):
            strategy(liveness_timeout=timedelta(0))
        strategy(liveness_timeout=None)  # off


def _validate_tiny(rank: int, world_size: int) -> str:
    cases.lightning_env(rank, world_size)
    trainer = cases.trainer(world_size)
    try:
        trainer.validate(
            cases.Classifier(), DataLoader(cases.classification_data(1), batch_size=1), verbose=False
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_exact_evaluation_on_fewer_samples_than_ranks_is_refused() -> None:
    messages = run_ranks(_validate_tiny, 2, timeout=60)
    assert all(
        "validation dataset has 1 samples for 2 ranks, so rank 1 would have none" in m for m in messages
    ), messages
