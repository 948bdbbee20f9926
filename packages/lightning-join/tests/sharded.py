"""A regression sharded with FSDP2 and its single-process reference, shared by the FSDP tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import cases
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

HIDDEN: Final = 6


def net() -> torch.nn.Sequential:
    """The unsharded two-layer network, the same on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(cases.FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )


def optimizer(params: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """SGD with momentum, and a learning rate multiplied by 0.8 at each scheduler step."""
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # Every step (or epoch): a joined rank's replayed steps need the learning rate of theirs.
    return sgd, torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.8)


class ShardedRegression(pl.LightningModule):
    """A two-layer regression sharded with fully_shard, trained with SGD,
    momentum and a learning rate multiplied by 0.8 every step (or epoch),
    logging a synced loss every step."""

    def __init__(self, interval: str = "step") -> None:
        super().__init__()
        self.net = net()
        self.interval = interval

    def configure_model(self) -> None:
        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True, batch_size=len(x))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True, on_epoch=True, batch_size=len(x))
        self.log(
            "val_count", float(len(x)), sync_dist=True, reduce_fx="sum", on_epoch=True, batch_size=len(x)
        )

    def configure_optimizers(self) -> Any:
        sgd, scheduler = optimizer(self.parameters())
        return {"optimizer": sgd, "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict on the CPU, every DTensor gathered whole.

    The shards travel as objects: torch 2.11's ``DTensor.full_tensor()`` (a
    functional all-gather) crashes on CUDA tensors over gloo."""
    state = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            shards: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(shards, value.to_local().detach().cpu())
            value = torch.cat(shards)  # fully_shard splits dim 0 as torch.chunk does
        state[key] = value.detach().cpu().clone()
    return state


def reference(
    counts: Sequence[int],
    epochs: int,
    divide: bool = True,
    interval: str = "step",
    clip: tuple[float, str] | None = None,
) -> dict[str, torch.Tensor]:
    """One process, the steps of ``len(counts)`` ranks where rank r has
    ``counts[r]`` batches of :func:`cases.regression_batches`: step i sums
    the gradients of the ranks that have a batch i, divided by the world
    size (or by their number), clipped (``clip``: the value and
    ``"norm"`` or ``"value"``) if asked, and the learning rate is multiplied
    by 0.8 every step (or epoch)."""
    model = net()
    sgd, scheduler = optimizer(model.parameters())
    shares = [cases.regression_batches(rank, count) for rank, count in enumerate(counts)]
    for _ in range(epochs):
        for step in range(max(counts)):
            sgd.zero_grad()
            active = [share[step] for share in shares if step < len(share)]
            divisor = len(counts) if divide else len(active)
            for x, y in active:
                (torch.nn.functional.mse_loss(model(x), y) / divisor).backward()
            if clip is not None and clip[1] == "norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip[0])
            elif clip is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip[0])
            sgd.step()
            if interval == "step":
                scheduler.step()
        if interval == "epoch":
            scheduler.step()
    return model.state_dict()
