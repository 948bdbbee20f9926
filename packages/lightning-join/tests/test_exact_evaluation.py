"""Validation and test metrics over every sample exactly once, whatever the world size."""

from __future__ import annotations

import cases
import pytest
import torch
from torch.utils.data import DataLoader

from join_core.testing import run_ranks

WORLD: int = 3
SAMPLES, BATCH = 25, 4  # shares of 9, 8 and 8 samples: 3, 2 and 2 batches


def _evaluate(
    rank: int, world_size: int, stage: str, dist_sync_on_step: bool
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    cases.lightning_env(rank, world_size)
    model = cases.Classifier(dist_sync_on_step)
    loader = DataLoader(cases.classification_data(SAMPLES), batch_size=BATCH)
    trainer = cases.trainer(world_size, max_epochs=1)
    if stage == "validate":
        trainer.validate(model, loader, verbose=False)
    elif stage == "test":
        trainer.test(model, loader, verbose=False)
    else:  # validation after an epoch of uneven training
        train = cases.loader(
            [(x, y) for x, y in DataLoader(cases.classification_data(4 + 2 * rank), batch_size=2)]
        )
        trainer.fit(model, train, loader)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _expected(model: cases.Classifier, prefix: str) -> dict[str, float]:
    x, y = cases.classification_data(SAMPLES).tensors
    with torch.no_grad():
        logits = model(x)
    losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    return {
        f"{prefix}_loss_epoch": float(losses.mean()),
        f"{prefix}_count": float(SAMPLES),
        f"{prefix}_accuracy": float((logits.argmax(1) == y).double().mean()),
        f"{prefix}_mean_loss": float(losses.mean()),
    }


@pytest.mark.parametrize(("stage", "dist_sync_on_step"), [("validate", True), ("test", False), ("fit", True)])
def test_metrics_equal_single_process_values(stage: str, dist_sync_on_step: bool) -> None:
    results = run_ranks(_evaluate, WORLD, stage, dist_sync_on_step, timeout=90)
    model = cases.Classifier()
    # After fit: the model every rank trained, validated at the end of its only epoch.
    model.load_state_dict(results[0][1])
    expected = _expected(model, "test" if stage == "test" else "val")
    if stage == "fit":  # every training sample of every rank counted once, on every rank
        expected["train_samples"] = float(sum(4 + 2 * rank for rank in range(WORLD)))
    for rank, (metrics, _) in enumerate(results):
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5), f"rank {rank}: {key}"
