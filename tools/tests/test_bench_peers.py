"""bench/peers: a peer that cannot install or run is named with the reason and the run
goes on; the workloads check what comes back; the table compares ours with the best other."""

from __future__ import annotations

import sys
from pathlib import Path

import dev
import pytest
import torch
from peers import report
from peers.runner import PEERS, Outcome, PeerSpec, run_once, run_peers
from peers.workloads import measure_pair, ps_rate

pytestmark = pytest.mark.timeout(120)


def test_a_peer_pip_cannot_install_is_named_with_pips_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str) -> Path:
        raise dev.EnvSetupError(
            f"[env] .venvs/{name}: pip install failed (exit 1)",
            "Collecting torchmonarch==0.7.0\nERROR: No matching distribution found for torchmonarch==0.7.0\n",
        )

    monkeypatch.setattr(dev, "try_ensure", fail)
    said: list[str] = []
    (outcome,) = run_peers(["monarch"], 1, True, say=said.append)
    reason = "pip could not install it: ERROR: No matching distribution found for torchmonarch==0.7.0"
    assert outcome.unavailable == reason
    page = report.table([outcome], 1, True, ["load average 1.0, 1.0, 1.0"])
    assert f"cannot run here: {reason}" in page
    assert "| cannot run here |" in page


def test_a_peer_whose_process_fails_is_reported_with_its_error() -> None:
    spec = PeerSpec("missing", "missing", "run", "peers.no_such_module", "torch", "torch")
    result = run_once(spec, Path(sys.executable), "pair", quick=True)
    assert isinstance(result, str)
    assert result.startswith("pair: exit 1: ")
    assert "No module named peers.no_such_module" in result


class _LocalPeer:
    """Calls that stay in this process, so that the workloads run in a test."""

    def __init__(self, change: bool = False) -> None:
        self.change = change
        self.calls = 0

    def noop(self, payload: bytes) -> None:
        assert len(payload) == 64
        self.calls += 1

    def noop_many(self, payload: bytes, count: int) -> None:
        self.calls += count

    def echo(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1 if self.change else x.clone()


def test_two_process_workloads_give_every_figure() -> None:
    peer = _LocalPeer()
    figures = measure_pair(peer, quick=True, launched_at=100.0, first_call_at=102.5)
    assert figures["startup_s"] == 2.5
    assert set(figures) == {r.key for r in report.ROWS} - {"ps_per_s"}
    assert 0 < figures["sync_p50_us"] <= figures["sync_p99_us"]
    assert peer.calls > 500


def test_an_echo_that_changes_the_tensor_is_an_error() -> None:
    with pytest.raises(AssertionError, match="the 1 MiB tensor came back changed"):
        measure_pair(_LocalPeer(change=True), quick=True, launched_at=0.0, first_call_at=0.0)


def test_parameter_server_rate_spans_the_first_start_to_the_last_end() -> None:
    assert ps_rate([(10.0, 12.0), (11.0, 14.0)], calls=100) == 200 / 4.0


def test_the_table_says_how_many_times_better_ours_is_than_the_best_other() -> None:
    ours, torch_rpc, ray, monarch = (Outcome(spec, version="1") for spec in PEERS)
    ours.samples = {"sync_p50_us": [40.0, 50.0, 60.0], "async_per_s": [12000.0]}
    torch_rpc.samples = {"sync_p50_us": [100.0], "async_per_s": [4000.0]}
    ray.samples = {"sync_p50_us": [900.0], "async_per_s": [6000.0]}
    monarch.failures = ["round 1, pair: timed out after 300 s (no output)"]
    page = report.table([ours, torch_rpc, ray, monarch], 3, False, ["load average 1.0, 1.0, 1.0"])
    rows = {line.split(" | ")[0].lstrip("| "): line for line in page.splitlines() if line.startswith("| ")}
    assert rows["rpc_sync no-op, 64-byte argument, p50"].endswith("| 50 | 100 | 900 | failed | 2.00x |")
    assert rows["rpc_async no-op throughput"].endswith("| 1.2e+04 | 4e+03 | 6e+03 | failed | 2.00x |")
    assert "  - round 1, pair: timed out after 300 s (no output)" in page
