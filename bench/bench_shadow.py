"""Benchmark: what ShadowCollectives costs a healthy step.

Two processes on 127.0.0.1 (gloo, CPU) train the DDP figures' MLP
(256-1024-1024-10, batch 32) with our DDP and all-reduce the loss every step,
as a loop that logs a metric does. The goal is checked on that step; the same
measure on Linear(16, 16), batch 8 (a step of well under a millisecond, where
the fixed cost per collective weighs most) is printed beside it in
microseconds per step. Adjacent
short runs under ``Join([model])`` and ``Join([model, ShadowCollectives()])``,
in alternating order, give one ratio each; the figure is their median (slow
drifts of the machine cancel out within a pair). A second run of
``Join([model])`` in each round gives the same ratio between two identical
runs: the noise floor the figure is printed with, next to the same ratio in
CPU time of the rank (which the machine's other load moves less). torch.profiler then counts
the gloo collectives of healthy iterations with and without it. torch has no
counterpart (its answer is ``throw_on_early_termination``), hence no torch
column.

On two cores that timed ratio swings by more than the goal between runs,
either way, so the goal is checked as the collective recorder's is: the cost
ShadowCollectives adds to one collective, measured in one process on torch's
fake backend (collectives that do nothing, so nothing else varies) with the
steps timed inside the Join, times the collectives of the MLP's step, over
that step's time on gloo. The timed ratio stays in the table beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from benchlib import Figure, cost_script_runs

from ddp_join import DistributedDataParallel
from join_core import Join, ShadowCollectives
from join_core.testing import run_ranks

__all__ = ["shadow_figures"]

_NONE = float("nan")  # no torch counterpart


#: workload -> (the model, its input)
_WORKLOADS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, int]]] = {
    "mlp": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(256, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        ),
        (32, 256),
    ),
    "tiny": (lambda: torch.nn.Linear(16, 16), (8, 16)),
}


def _trainer(
    workload: str,
) -> tuple[DistributedDataParallel[torch.nn.Module], torch.optim.Optimizer, torch.Tensor]:
    make, shape = _WORKLOADS[workload]
    torch.manual_seed(0)
    model: DistributedDataParallel[torch.nn.Module] = DistributedDataParallel(make())
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(*shape)


def _join(model: DistributedDataParallel[torch.nn.Module], shadow: bool) -> Join:
    return Join([model, ShadowCollectives()] if shadow else [model])


def _steps(
    model: DistributedDataParallel[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    data: torch.Tensor,
    steps: int,
) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(data).pow(2).mean()
        loss.backward()
        optimizer.step()
        dist.all_reduce(loss.detach())  # the metric sync ShadowCollectives would shadow


def _timed(
    model: DistributedDataParallel[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    data: torch.Tensor,
    steps: int,
    shadow: bool,
) -> float:
    dist.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    with _join(model, shadow):
        _steps(model, optimizer, data, steps)
    _cpu_times.append((time.thread_time() - cpu) / steps)
    dist.barrier()
    return (time.perf_counter() - start) / steps


_cpu_times: list[float] = []  # CPU seconds per step of each timed run, in order


def _overhead(rank: int, world_size: int, workload: str, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per round, seconds per step with ShadowCollectives over seconds per step
    without ("shadow"), and without over without ("control"); and seconds per
    step without ("step")."""
    torch.set_num_threads(1)
    model, optimizer, data = _trainer(workload)
    for shadow in (False, True):
        _timed(model, optimizer, data, 20, shadow)  # warm-up
    ratios: dict[str, list[float]] = {"shadow": [], "control": [], "cpu": [], "step": []}
    runs = [("join", False), ("shadow", True), ("again", False)]
    for round_ in range(rounds):
        times, cpu = {}, {}
        for key, shadow in runs[:: 1 - 2 * (round_ % 2)]:
            times[key] = _timed(model, optimizer, data, steps, shadow)
            cpu[key] = _cpu_times[-1]
        ratios["shadow"].append(times["shadow"] / times["join"])
        ratios["control"].append(times["again"] / times["join"])
        ratios["cpu"].append(cpu["shadow"] / cpu["join"])
        ratios["step"].append(times["join"])
    return ratios


def _collectives(rank: int, world_size: int) -> dict[str, int]:
    """gloo collectives of 5 healthy iterations, with and without ShadowCollectives."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    model, optimizer, data = _trainer("mlp")
    for shadow in (False, True):
        with _join(model, shadow):
            _steps(model, optimizer, data, 1)  # warm-up, not counted
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _steps(model, optimizer, data, 5)
        counts["shadow" if shadow else "join"] = sum(
            1 for event in prof.events() if event.name.startswith("gloo:")
        )
    return counts


# One process on torch's fake backend: Linear(16, 16) under Join with and without
# ShadowCollectives in adjacent pairs, the steps (with the metric all-reduce) timed inside
# the Join; what it adds per step, and the collectives of a step (the recorder's count).
# A world of one: the fake backend's all-reduce leaves the heartbeat's sum at this rank's
# own count, which in a larger world would read as ranks that joined (ShadowCollectives
# then compares every collective across ranks, as it does once one has joined).
_COST_SCRIPT = """
import json, statistics, time, torch, torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=1)
torch.set_num_threads(1)
import join_core
from ddp_join import DistributedDataParallel
from join_core import Join, ShadowCollectives
recorder = join_core.record_collectives()
model = DistributedDataParallel(torch.nn.Linear(16, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(8, 16)
def steps(n, shadow):
    with Join([model, ShadowCollectives()] if shadow else [model]):
        start = time.perf_counter()
        for _ in range(n):
            optimizer.zero_grad()
            loss = model(data).pow(2).mean()
            loss.backward()
            optimizer.step()
            dist.all_reduce(loss.detach())
        return (time.perf_counter() - start) / n
steps(50, False); steps(50, True)
added = []
for pair in range(20):
    times = {}
    for shadow in ((True, False) if pair % 2 == 0 else (False, True)):
        times[shadow] = steps(300, shadow)
    added.append(times[True] - times[False])
before = recorder.records()[-1].seq
steps(100, False)
collectives = (recorder.records()[-1].seq - before) / 100
print(json.dumps({"added": statistics.median(added), "collectives": collectives}))
"""


def _cost_per_collective() -> float:
    """Seconds ShadowCollectives adds to one collective (the median of three processes)."""
    runs = cost_script_runs(_COST_SCRIPT, "ShadowCollectives' cost")
    return statistics.median(run["added"] / run["collectives"] for run in runs)


def shadow_figures(rounds: int, quick: bool) -> list[Figure]:
    """The overhead of ShadowCollectives on a healthy step, and its extra collectives."""
    pairs = max(rounds * 2, 10 if quick else 30)
    tiny: Any = run_ranks(_overhead, 2, "tiny", pairs, 50 if quick else 100, timeout=900)[0]
    ratios: Any = run_ranks(_overhead, 2, "mlp", pairs, 10 if quick else 30, timeout=900)[0]
    for name, found in (("Linear(16,16)", tiny), ("MLP", ratios)):
        overhead = statistics.median(found["shadow"]) - 1
        step = statistics.median(found["step"])
        print(
            f"ShadowCollectives overhead, {name} step of {step * 1e3:.2f} ms: {overhead * 100:+.2f} % "
            f"({overhead * step * 1e6:+.0f} us) in wall time (two identical runs differ by "
            f"{(statistics.median(found['control']) - 1) * 100:+.2f} %), "
            f"{(statistics.median(found['cpu']) - 1) * 100:+.2f} % in CPU time of the rank"
        )
    timed = statistics.median(ratios["shadow"]) - 1
    cost = _cost_per_collective()
    counts = run_ranks(_collectives, 2, timeout=300)[0]
    per_step = counts["join"] / 5  # the MLP's gradient buckets and the metric all-reduce
    overhead = cost * per_step / statistics.median(ratios["step"])
    print(f"ShadowCollectives: {cost * 1e6:.2f} us per collective, {per_step:.0f} per MLP step")
    extra = (counts["shadow"] - counts["join"]) / 5
    return [
        Figure(
            "ShadowCollectives cost per collective (one process, fake backend, Linear(16,16) + metric all-reduce)",
            "us",
            cost * 1e6,
            _NONE,
            "(context)",
            _NONE,
            True,
        ),
        Figure(
            "ShadowCollectives overhead per step, MLP 256-1024-1024-10 batch 32 + metric all-reduce "
            f"({per_step:.0f} collectives x cost / step time)",
            "% of the step",
            overhead * 100,
            _NONE,
            "<= 1%",
            overhead * 100,
            overhead <= 0.01,
        ),
        Figure(
            "  the same step timed under Join with and without ShadowCollectives, median of "
            f"{pairs} pairs (entry and exit included)",
            "% over Join alone",
            timed * 100,
            _NONE,
            "(context)",
            _NONE,
            True,
        ),
        Figure(
            "extra collectives per healthy iteration with ShadowCollectives",
            "gloo ops",
            extra,
            _NONE,
            "0 extra",
            extra,
            extra <= 0,
        ),
    ]


if __name__ == "__main__":
    for figure in shadow_figures(5, quick=False):
        print(figure)
