"""The collective recorder's cost on a healthy step: our DDP under Join (the
watch and its heartbeat summaries on, the defaults) with the recorder on and
off, in adjacent pairs inside the same two processes; and the gloo ops it
adds (none: it records locally, and the summaries ride the store)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from benchlib import Figure
from torch.profiler import ProfilerActivity, profile

import join_core
from ddp_join import DistributedDataParallel
from join_core.testing import run_ranks

_NONE = float("nan")


def _model(name: str) -> torch.nn.Module:
    if name == "tiny":
        return torch.nn.Linear(16, 16)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def _steps(model: Any, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    with model.join():
        for _ in range(steps):
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _overhead(rank: int, world_size: int, name: str, pairs: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    model = DistributedDataParallel(_model(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32 if name == "mlp" else 8, 256 if name == "mlp" else 16)
    recorder = join_core.recorder()
    assert recorder is not None
    _steps(model, optimizer, data, 10)  # warm-up
    found: dict[str, list[float]] = {"ratio": [], "step": []}
    for pair in range(pairs):
        times = {}
        for enabled in (True, False) if pair % 2 == 0 else (False, True):
            recorder.enabled = enabled
            times[enabled] = _steps(model, optimizer, data, steps)
        found["ratio"].append(times[True] / times[False])
        found["step"].append(times[False])
    recorder.enabled = True
    return found


def _gloo_ops(rank: int, world_size: int) -> dict[str, int]:
    model = DistributedDataParallel(_model("tiny"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    recorder = join_core.recorder()
    assert recorder is not None
    counts = {}
    for enabled in (False, True):
        recorder.enabled = enabled
        with model.join():
            model(data).sum().backward()  # warm-up, not counted
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    optimizer.zero_grad()
                    model(data).pow(2).mean().backward()
                    optimizer.step()
        counts["on" if enabled else "off"] = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
    return counts


def recorder_figures(rounds: int, quick: bool) -> list[Figure]:
    """The recorder's overhead per step and its extra collectives."""
    pairs = max(rounds * 2, 10 if quick else 30)
    figures = []
    for name, label, steps in (
        ("tiny", "Linear(16,16) batch 8", 100),
        ("mlp", "MLP 256-1024-1024-10 batch 32", 30),
    ):
        found: Any = run_ranks(_overhead, 2, name, pairs, steps // 2 if quick else steps, timeout=900)[0]
        overhead = statistics.median(found["ratio"]) - 1
        step = statistics.median(found["step"])
        print(f"collective recorder, {label} step of {step * 1e3:.2f} ms: {overhead * 100:+.2f} %")
        figures.append(
            Figure(
                f"Collective recorder overhead per step under Join, {label}",
                "% over recorder off",
                overhead * 100,
                _NONE,
                "<= 1%",
                overhead * 100,
                overhead <= 0.01,
            )
        )
    counts = run_ranks(_gloo_ops, 2, timeout=300)[0]
    extra = (counts["on"] - counts["off"]) / 5
    figures.append(
        Figure(
            "extra collectives per healthy iteration with the recorder and hang watch",
            "gloo ops",
            extra,
            _NONE,
            "0 extra",
            extra,
            extra <= 0,
        )
    )
    return figures
