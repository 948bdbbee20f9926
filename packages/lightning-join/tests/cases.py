"""Lightning modules, data and Trainers shared by the tests; each rank runs them.

``LIGHTNING_JOIN_BASELINE=1`` in the environment runs the same scenarios with
Lightning's own DDPStrategy instead, to see that each test fails without
JoinDDPStrategy (they hang until the ranks' timeout, or compute padded
metrics).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any, Final

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_join import JoinDDPStrategy

BASELINE: Final = os.environ.get("LIGHTNING_JOIN_BASELINE") == "1"
# LIGHTNING_JOIN_DEVICE=cuda runs every rank on the one GPU (cuda:0) over gloo:
# each rank is then a node of one device, as Lightning maps ranks to devices.
DEVICE: Final = os.environ.get("LIGHTNING_JOIN_DEVICE", "cpu")
FEATURES: Final = 4
CLASSES: Final = 3


def lightning_env(rank: int, world_size: int) -> None:
    """What Lightning reads to know that this process is rank ``rank`` of an
    already started job (the process group is initialised by run_ranks)."""
    os.environ.update(
        LOCAL_RANK="0" if DEVICE == "cuda" else str(rank),
        NODE_RANK=str(rank) if DEVICE == "cuda" else "0",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
    )
    os.environ.setdefault("MASTER_PORT", "29500")
    # Lightning's advice about dataloader workers and logging is noise on two cores.
    warnings.filterwarnings("ignore", module="lightning")


def strategy(**kwargs: Any) -> Strategy:
    """JoinDDPStrategy(**kwargs), or with LIGHTNING_JOIN_BASELINE=1 Lightning's DDPStrategy."""
    if BASELINE:
        return DDPStrategy()
    return JoinDDPStrategy(**kwargs)


def placement(world_size: int) -> dict[str, Any]:
    """The accelerator, devices and nodes of a Trainer or Fabric over ``world_size`` ranks."""
    if DEVICE == "cuda":
        return {"accelerator": "cuda", "devices": 1, "num_nodes": world_size}
    return {"accelerator": "cpu", "devices": world_size}


def trainer(world_size: int, root: str | None = None, **kwargs: Any) -> pl.Trainer:
    """A quiet Trainer over ``world_size`` ranks with the strategy under test; its root is ``root``,
    or a folder that it does not make, since it writes no logs and no checkpoints."""
    options: dict[str, Any] = dict(
        **placement(world_size),
        strategy=strategy(exact_eval=True),
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root or os.path.join(tempfile.gettempdir(), f"lightning-unwritten-{os.getpid()}"),
    )
    options.update(kwargs)
    return pl.Trainer(**options)


def regression_batches(rank: int, count: int, batch_size: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of rank ``rank``'s own regression data (deterministic)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return [
        (
            torch.randn(batch_size, FEATURES, generator=generator),
            torch.randn(batch_size, 1, generator=generator),
        )
        for _ in range(count)
    ]


def loader(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> DataLoader[tuple[torch.Tensor, ...]]:
    """A dataloader that yields ``batches`` in order."""
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return DataLoader(TensorDataset(x, y), batch_size=len(batches[0][0]), shuffle=False)


class Regression(pl.LightningModule):
    """A linear regression trained with SGD and momentum, logging a synced loss every step."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(FEATURES, 1)
        self.lr = lr
        self.momentum = momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True, batch_size=len(x))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def classification_data(count: int = 25) -> TensorDataset:
    """``count`` labelled samples, the same on every rank."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(count, FEATURES, generator=generator)
    return TensorDataset(x, torch.randint(0, CLASSES, (count,), generator=generator))


class Classifier(pl.LightningModule):
    """Logs, on validation and test, a synced mean loss (each step and over
    the epoch), a synced sample count, and torchmetrics' accuracy and mean
    loss; in training, torchmetrics' count of samples. torchmetrics metrics
    are optionally synced on every step."""

    def __init__(self, dist_sync_on_step: bool = False) -> None:
        super().__init__()
        import torchmetrics

        torch.manual_seed(0)
        self.net = torch.nn.Linear(FEATURES, CLASSES)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(
            num_classes=CLASSES, average="micro", dist_sync_on_step=dist_sync_on_step
        )
        self.mean_loss = torchmetrics.MeanMetric(dist_sync_on_step=dist_sync_on_step)
        self.train_samples = torchmetrics.SumMetric(dist_sync_on_step=dist_sync_on_step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.train_samples(torch.tensor(float(len(x))))  # synced on every step when asked
        self.log("train_samples", self.train_samples, on_step=False, on_epoch=True)
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, y = batch
        logits = self.net(x)
        losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        self.accuracy(logits, y)
        self.mean_loss(losses)
        n = len(x)
        self.log(f"{stage}_loss", losses.mean(), sync_dist=True, on_step=True, on_epoch=True, batch_size=n)
        self.log(f"{stage}_count", float(n), sync_dist=True, reduce_fx="sum", on_epoch=True, batch_size=n)
        self.log(f"{stage}_accuracy", self.accuracy, on_epoch=True)
        self.log(f"{stage}_mean_loss", self.mean_loss, on_epoch=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def DDPStrategyFabric() -> Any:
    """Fabric's own DDPStrategy (for LIGHTNING_JOIN_BASELINE=1)."""
    from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDPStrategy

    return FabricDDPStrategy()
