"""ModelCheckpoint and EarlyStopping agree on every rank, a joined one included."""

from __future__ import annotations

import os
import tempfile

import cases
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from join_core.testing import run_ranks

WORLD: int = 2
MAX_EPOCHS: int = 5


def _fit(rank: int, world_size: int, root: str) -> dict[str, object]:
    cases.lightning_env(rank, world_size)
    model = cases.Classifier()
    checkpoint = ModelCheckpoint(dirpath=root, monitor="val_mean_loss", save_top_k=1, save_last=True)
    # val_count never improves on the first epoch's: training stops after the second.
    stopping = EarlyStopping(monitor="val_count", patience=1)
    trainer = cases.trainer(
        world_size, root, max_epochs=MAX_EPOCHS, callbacks=[checkpoint, stopping], enable_checkpointing=True
    )
    data = cases.classification_data(4 + 4 * rank)  # 2 batches on rank 0, 4 on rank 1
    val = DataLoader(cases.classification_data(25), batch_size=4)
    trainer.fit(model, DataLoader(data, batch_size=2), val)
    return {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "best": checkpoint.best_model_path,
        "last": checkpoint.last_model_path,
        "stopped_epoch": stopping.stopped_epoch,
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }


def test_checkpoints_and_early_stopping_agree_on_every_rank() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_fit, WORLD, root, timeout=90)
        for key in ("epoch", "global_step", "best", "last", "stopped_epoch"):
            assert len({str(r[key]) for r in results}) == 1, f"{key}: {[r[key] for r in results]}"
        first = results[0]
        assert first["stopped_epoch"] == 1 and first["epoch"] == 2  # stopped early, after two epochs
        assert first["global_step"] == 2 * 4  # the longest rank's steps, on every rank
        last = torch.load(str(first["last"]), weights_only=False, map_location="cpu")
        assert last["global_step"] == first["global_step"]
        state = first["state"]
        assert isinstance(state, dict)
        for key, value in state.items():
            torch.testing.assert_close(last["state_dict"][key], value)
        assert os.path.isfile(str(first["best"]))
