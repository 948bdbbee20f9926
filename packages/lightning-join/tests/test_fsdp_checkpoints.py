"""JoinFSDPStrategy: checkpoints saved with uneven batches, and training resumed from them."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import cases
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from sharded import ShardedRegression, full_state, reference
from torch.utils.data import DataLoader

from join_core.testing import run_ranks
from lightning_join import JoinFSDPStrategy

WORLD: int = 3
COUNTS: tuple[int, ...] = (2, 3, 4)  # training batches of each rank
FIRST, TOTAL = 2, 4  # epochs before the checkpoint, and in all
SAMPLES: int = 10  # validation samples (exact_eval: 4, 3 and 3 on the three ranks)


def _validation() -> DataLoader[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, cases.FEATURES, generator=generator)
    data = torch.utils.data.TensorDataset(x, torch.randn(SAMPLES, 1, generator=generator))
    return DataLoader(data, batch_size=2)


class _CountBatches(Callback):
    """Counts the training batches this rank runs."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.batches += 1


def _fit(
    rank: int, world_size: int, root: str, distributed: bool, epochs: int, resume: str | None
) -> dict[str, Any]:
    """Fit to ``epochs`` (from ``resume`` if given), validating and saving a
    checkpoint after every epoch (ranked by ``val_loss``, and the last)."""
    cases.lightning_env(rank, world_size)
    counter = _CountBatches()
    checkpoint = ModelCheckpoint(
        dirpath=root, filename="{epoch}-{step}", monitor="val_loss", save_top_k=-1, save_last=True
    )
    trainer = cases.trainer(
        world_size,
        root,
        max_epochs=epochs,
        strategy=JoinFSDPStrategy(exact_eval=True, save_distributed_checkpoint=distributed),
        callbacks=[checkpoint, counter],
        enable_checkpointing=True,
    )
    model = ShardedRegression()
    train = cases.loader(cases.regression_batches(rank, COUNTS[rank]))
    trainer.fit(model, train, _validation(), ckpt_path=resume)
    return {
        "state": full_state(model.net),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "last": checkpoint.last_model_path,
        "best": checkpoint.best_model_path,
        "batches": counter.batches,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
    }


def _agree(results: list[dict[str, Any]], *keys: str) -> None:
    for key in keys:
        assert len({str(r[key]) for r in results}) == 1, f"{key}: {[r[key] for r in results]}"


def _saved(path: str, distributed: bool) -> tuple[dict[str, torch.Tensor], int]:
    """The model's parameters and the global step in a checkpoint, read in this process."""
    expected = reference(COUNTS, 0)  # the keys and shapes
    if distributed:  # a folder of shards and Lightning's metadata file
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint.state_dict_loader import load

        state = {"state_dict": {f"net.{key}": torch.empty_like(value) for key, value in expected.items()}}
        with warnings.catch_warnings():  # that it loads in one process, as meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load(state, checkpoint_id=path, no_dist=True)
        metadata = torch.load(os.path.join(path, _METADATA_FILENAME), weights_only=False)
        return {k.removeprefix("net."): v for k, v in state["state_dict"].items()}, metadata["global_step"]
    checkpoint = torch.load(path, weights_only=False)
    return {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()}, checkpoint["global_step"]


def _assert_reference(states: list[dict[str, torch.Tensor]], epochs: int) -> None:
    expected = reference(COUNTS, epochs)
    for rank, state in enumerate(states):
        assert state.keys() == expected.keys(), f"rank {rank}"
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("distributed", [True, False], ids=["sharded", "full"])
def test_training_resumed_from_a_checkpoint_ends_with_the_single_process_model(distributed: bool) -> None:
    if not distributed and cases.DEVICE == "cuda":
        # Lightning gathers the full state with DTensor.full_tensor(): an
        # all-gather that kills torch 2.11's gloo on CUDA tensors (SIGSEGV).
        pytest.skip("a full checkpoint of CUDA shards over gloo crashes torch's gloo; on GPUs use NCCL")
    steps = max(COUNTS)  # per epoch, the longest rank's
    with tempfile.TemporaryDirectory() as root:
        first = run_ranks(_fit, WORLD, root, distributed, FIRST, None, timeout=150)
        # Every rank, the ones that joined before the others included, saved the
        # same checkpoints, after every rank's last batch of the epoch.
        _agree(first, "global_step", "epoch", "last", "best")
        assert first[0]["global_step"] == FIRST * steps
        last = str(first[0]["last"])
        assert os.path.isdir(last) if distributed else os.path.isfile(last), last
        saved, global_step = _saved(last, distributed)
        assert global_step == FIRST * steps
        _assert_reference([saved, *(r["state"] for r in first)], FIRST)

        resumed = run_ranks(_fit, WORLD, root, distributed, TOTAL, last, timeout=150)
        _agree(resumed, "global_step", "epoch", "last", "best", "lr")
        # Resumed after the checkpoint's epochs: each rank ran only the batches of the others.
        assert [r["batches"] for r in resumed] == [(TOTAL - FIRST) * count for count in COUNTS]
        assert resumed[0]["global_step"] == TOTAL * steps
        assert resumed[0]["lr"] == pytest.approx(0.1 * 0.8 ** (TOTAL * steps))
        # Momentum and learning rate restored: the model of an uninterrupted single process.
        _assert_reference([r["state"] for r in resumed], TOTAL)
        for rank, result in enumerate(resumed):
            for key, value in resumed[0]["state"].items():
                assert torch.equal(result["state"][key], value), f"rank {rank}: {key}"
