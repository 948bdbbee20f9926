"""The collective recorder's cost on a healthy step.

Its own cost per collective is measured in one process on torch's fake
backend (collectives that do nothing, so nothing but the recorder varies),
on our DDP's step under Join: microseconds. The overhead per step, which has the
goal, is that cost times the collectives our DDP step under Join issues (the
watch and its heartbeat summaries on, the defaults), over the step's time.
The step timed with the recorder on and off in adjacent pairs is shown
beside it: on two cores its spread (several percent, either way) is wider
than the goal. And the gloo ops it adds: none (it records locally; the
summaries ride the store)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from benchlib import Figure, cost_script_runs
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


# One process on torch's fake backend (collectives that do nothing, so
# nothing but the recorder varies): our DDP's step under Join, the recorder
# on and off in adjacent pairs; what it adds per collective, the user's call
# site found from inside the backward included.
_COST_SCRIPT = """
import json, statistics, time, torch, torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
torch.set_num_threads(1)
import join_core
from ddp_join import DistributedDataParallel
recorder = join_core.record_collectives()
model = DistributedDataParallel(torch.nn.Linear(16, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(8, 16)
def steps(n):
    start = time.perf_counter()
    with model.join():
        for _ in range(n):
            optimizer.zero_grad(); model(data).pow(2).mean().backward(); optimizer.step()
    return (time.perf_counter() - start) / n
steps(50)
added, counts = [], []
for pair in range(20):
    times = {}
    for enabled in ((True, False) if pair % 2 == 0 else (False, True)):
        recorder.enabled = enabled
        before = recorder.records()[-1].seq if recorder.records() else 0
        times[enabled] = steps(300)
        if enabled:
            counts.append((recorder.records()[-1].seq - before) / 300)
    added.append(times[True] - times[False])
print(json.dumps({"added": statistics.median(added), "collectives": statistics.median(counts)}))
"""


def _cost_per_collective() -> float:
    """Seconds the recorder adds to one collective of our DDP's backward (the median of three processes)."""
    runs = cost_script_runs(_COST_SCRIPT, "the recorder's cost")
    return statistics.median(run["added"] / run["collectives"] for run in runs)


def _overhead(rank: int, world_size: int, name: str, pairs: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    model = DistributedDataParallel(_model(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32 if name == "mlp" else 8, 256 if name == "mlp" else 16)
    recorder = join_core.recorder()
    assert recorder is not None
    _steps(model, optimizer, data, 10)  # warm-up
    found: dict[str, list[float]] = {"ratio": [], "step": [], "collectives": []}
    for pair in range(pairs):
        times = {}
        for enabled in (True, False) if pair % 2 == 0 else (False, True):
            recorder.enabled = enabled
            before = len(recorder.records())
            times[enabled] = _steps(model, optimizer, data, steps)
            if enabled:
                # The ring holds them all (steps < capacity); the barriers are the bench's.
                found["collectives"].append((len(recorder.records()) - before - 2) / steps)
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
    """The recorder's cost per collective and per step, and its extra collectives."""
    pairs = max(rounds * 2, 10 if quick else 30)
    cost = _cost_per_collective()
    print(f"collective recorder: {cost * 1e6:.2f} us per collective")
    figures = [
        Figure(
            "Collective recorder cost per collective of our DDP step (one process, fake backend)",
            "us",
            cost * 1e6,
            _NONE,
            "(context)",
            _NONE,
            True,
            "none",
        ),
    ]
    for name, label, steps in (
        ("tiny", "Linear(16,16) batch 8", 100),
        ("mlp", "MLP 256-1024-1024-10 batch 32", 30),
    ):
        found: Any = run_ranks(_overhead, 2, name, pairs, steps // 2 if quick else steps, timeout=900)[0]
        step = statistics.median(found["step"])
        per_step = statistics.median(found["collectives"])
        overhead = cost * per_step / step
        quartiles = statistics.quantiles([r - 1 for r in found["ratio"]], n=4)
        timed = quartiles[1]
        print(
            f"collective recorder, {label}: {per_step:.1f} collectives per {step * 1e3:.2f} ms step: "
            f"{overhead * 100:+.2f} %; timed on/off {timed * 100:+.2f} % "
            f"(quartiles {quartiles[0] * 100:+.2f} .. {quartiles[2] * 100:+.2f} %)"
        )
        figures.append(
            Figure(
                f"Collective recorder overhead per step under Join, {label} "
                f"({per_step:.0f} collective(s) x cost / step time)",
                "% of the step",
                overhead * 100,
                _NONE,
                "<= 1%",
                overhead * 100,
                overhead <= 0.01,
                "none",
            )
        )
        figures.append(
            Figure(
                f"  the same step timed with the recorder on vs off, median of {pairs} pairs "
                f"(quartiles {quartiles[0] * 100:+.1f} .. {quartiles[2] * 100:+.1f} %)",
                "% over recorder off",
                timed * 100,
                _NONE,
                "(context)",
                _NONE,
                True,
                "none",
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
            "none",
        )
    )
    return figures
