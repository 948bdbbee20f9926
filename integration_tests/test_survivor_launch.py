"""DDP training under `python -m join_core.launch` with
Join(on_rank_lost="continue"): a worker kills itself mid-training and the
survivors finish with the parameters a single process computes from the
batches each rank contributed; the agent exits with 0. And the case the
launcher exists for: a store served by rank 0's own process, which Join warns
about at the start and names when rank 0 is lost."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import launch
from train_survivor_launch import LR, batch_id
from training_common import reference_dense

from join_core.testing import LaunchExit, run_launch

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "train_survivor_launch.py"
STEPS = 8
LOST_AT = 3

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform != "linux", reason="the launcher tests count workers through /proc"),
]


def _report(run: LaunchExit) -> str:
    return f"exit {run.returncode}\n{run.output}"


def _result(result_dir: Path, rank: int) -> dict[str, Any]:
    with open(result_dir / f"rank{rank}.pkl", "rb") as f:
        result: dict[str, Any] = pickle.load(f)
    return result


@pytest.mark.parametrize("lost", [2, 0], ids=["rank-2", "rank-0"])
def test_survivors_under_the_launcher_finish_with_the_expected_parameters(lost: int, tmp_path: Path) -> None:
    args = ["--lose-rank", str(lost), "--lose-at", str(LOST_AT), "--steps", str(STEPS)]
    run = run_launch(SCRIPT, 3, *args, "--result-dir", str(tmp_path), timeout=90)
    assert run.returncode == 0, _report(run)
    assert f"worker rank {lost} (" in run.output and "lost: killed by SIGKILL" in run.output, _report(run)
    assert "job succeeded: 2 of 3 workers finished; 1 lost" in run.output, _report(run)
    assert not run.leaked, _report(run)
    survivors = [rank for rank in range(3) if rank != lost]
    results = {rank: _result(tmp_path, rank) for rank in survivors}
    # The lost rank's gradients count in the iterations before the one it died in.
    batches = [
        [batch_id(rank, step) for step in range(LOST_AT if rank == lost else STEPS)] for rank in range(3)
    ]
    expected = reference_dense(batches, lambda params: torch.optim.SGD(params, lr=LR))
    for rank in survivors:
        assert results[rank]["lost"] == [lost], results[rank]
        assert results[rank]["group_size"] == 2
        torch.testing.assert_close(results[rank]["params"], expected, rtol=1e-5, atol=1e-6)


def test_a_store_served_by_rank_0_is_warned_about_and_its_loss_is_named(tmp_path: Path) -> None:
    # Lost 1 s in: the survivors' watches have read by then who serves the store.
    losing = ["--lose-rank", "0", "--lose-at", "5", "--step-time", "0.2"]
    exits = launch(SCRIPT, 3, [*losing, "--store-file", str(tmp_path / "port")], timeout=60, grace=25)
    fix = "launch with `python -m join_core.launch`"
    assert exits[0].returncode == -9, exits[0].output
    assert "RuntimeWarning: Join(on_rank_lost='continue'): this process (rank 0) serves" in exits[0].output
    assert fix in exits[0].output
    for survivor in exits[1:]:
        assert survivor.returncode not in (0, -9), survivor.output  # it ended with the error, not killed
        assert "RankLostError" in survivor.output, survivor.output
        assert "rank 0's process served the process group's store" in survivor.output, survivor.output
        assert fix in survivor.output, survivor.output
