"""Benchmark: a Lightning training step with JoinDDPStrategy against DDPStrategy.

Two processes on 127.0.0.1 (gloo, CPU) fit the DDP figures' MLP
(256-1024-1024-10, batch 32) on even data, logging the loss with
``sync_dist=True`` every step, as Lightning users do. Each round fits once
with each strategy, in alternating order, in the same two processes; a
callback times the steps after the first few (Join's entry at the first
batch, and the exit and state check after the last, are inside the timed
span). The figure is the median over rounds of DDPStrategy's step time over
ours: on even data the strategy should cost nothing (goal: within 2 %). The
same ratio in CPU time of rank 0, which the machine's other load moves
less, is printed beside it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from benchlib import Figure

from join_core.testing import run_ranks

__all__ = ["lightning_figures"]

_WARMUP = 3  # steps of each fit left out of the timing


def _fit_time(world_size: int, join: bool, steps: int) -> tuple[float, float]:
    """Seconds per step of one fit, with JoinDDPStrategy or Lightning's
    DDPStrategy: wall-clock, and CPU time of this rank's process."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_join import JoinDDPStrategy

    class Timer(pl.Callback):
        start = end = cpu_start = cpu_end = 0.0

        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
        ) -> None:
            if batch_idx == _WARMUP:
                self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.end, self.cpu_end = time.perf_counter(), time.process_time()

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(256, 1024),
                torch.nn.ReLU(),
                torch.nn.Linear(1024, 1024),
                torch.nn.ReLU(),
                torch.nn.Linear(1024, 10),
            )

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.net(batch[0]).pow(2).mean()
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    timer = Timer()
    data = TensorDataset(torch.randn(32 * steps, 256))
    # Lightning's root folder is of no use after the fit: removed with what it holds.
    with tempfile.TemporaryDirectory(prefix="bench-lightning-") as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=JoinDDPStrategy() if join else DDPStrategy(),
            use_distributed_sampler=False,
            max_epochs=1,
            callbacks=[timer],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=root,
        )
        trainer.fit(MLP(), DataLoader(data, batch_size=32))
    timed = steps - _WARMUP
    return (timer.end - timer.start) / timed, (timer.cpu_end - timer.cpu_start) / timed


def _rounds(rank: int, world_size: int, steps: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # unused: the process group exists already
    warnings.filterwarnings("ignore", module="lightning")
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "lightning": []}
    for index in range(rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        for join in order:
            times["ours" if join else "lightning"].append(_fit_time(world_size, join, steps))
    return times


def lightning_figures(rounds: int, quick: bool) -> list[Figure]:
    """JoinDDPStrategy's step against DDPStrategy's, on even data."""
    # A fit's steps take well under a second beside Lightning's set-up: many steps
    # and at least five pairs keep the ratio's spread below its goal's 2 %.
    steps = 15 if quick else 150
    times = run_ranks(_rounds, 2, steps, rounds if quick else max(rounds, 5), timeout=1800)[0]
    ours, theirs = times["ours"], times["lightning"]
    ratio = statistics.median(t[0] / o[0] for o, t in zip(ours, theirs))
    cpu_ratio = statistics.median(t[1] / o[1] for o, t in zip(ours, theirs))
    return [
        Figure(
            "Lightning step, JoinDDPStrategy vs DDPStrategy, MLP, batch 32, even data, sync_dist log "
            f"(in CPU time of rank 0: {cpu_ratio:.2f}x)",
            "ms/step",
            statistics.median(o[0] for o in ours) * 1e3,
            statistics.median(t[0] for t in theirs) * 1e3,
            ">= 0.98x",
            ratio,
            ratio >= 0.98,
            reference="DDPStrategy",
        )
    ]
