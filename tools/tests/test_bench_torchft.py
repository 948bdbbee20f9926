"""bench/bench_torchft.py: where torchft cannot install or run, its figures say why and
the bench goes on."""

from __future__ import annotations

import sys
from pathlib import Path

import bench_torchft
import dev
import pytest
from benchlib import write_results
from peers.environments import Ready

pytestmark = pytest.mark.timeout(120)


def test_torchft_that_pip_cannot_install_is_named_in_the_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fail(name: str) -> Path:
        raise dev.EnvSetupError(
            f"[env] .venvs/{name}: pip install failed (exit 1)",
            "Collecting torchft==0.2.0\nERROR: No matching distribution found for torchft==0.2.0\n",
        )

    monkeypatch.setattr(dev, "try_ensure", fail)
    figures = bench_torchft.torchft_figures(0.5, runs=1)
    assert len(figures) == 2
    reason = (
        "not measured: pip could not install it: ERROR: No matching distribution found for torchft==0.2.0"
    )
    for figure in figures:
        assert figure.ours == 0.5
        assert figure.torch != figure.torch  # NaN
        assert figure.met
        assert figure.reference.endswith(reason)
    table = write_results(figures, 1, tmp_path)
    row = table.splitlines()[-1]
    assert "ours against torchft, lighthouse --join_timeout_ms 100 |" in row
    assert f"| - (torchft 0.2.0, 3 replica groups: {reason}) |" in row
    assert row.endswith("| (context) | - | yes |")


def test_a_torchft_run_that_fails_is_reported_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # This interpreter has no torchft_lighthouse beside it: the driver fails at once.
    monkeypatch.setattr(bench_torchft, "prepare", lambda *args: Ready(Path(sys.executable), "0.2.0"))
    found = bench_torchft.torchft_recovery(1)
    assert found.seconds != found.seconds  # NaN
    assert (found.completed, found.runs, found.version) == (0, 1, "0.2.0")
    assert found.reason.startswith("1 of 1 runs failed: exit 1: FileNotFoundError")
    assert "torchft_lighthouse" in found.reason


def test_runs_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="runs=0: need at least 1 run"):
        bench_torchft.torchft_recovery(0)
