"""Benchmarks of FSDP2 under Join and of ZeroRedundancyOptimizer's memory.

    python bench/bench_fsdp.py [--rounds N] [--quick]

- FSDP2 step time under ``Join([FSDPJoinable(...)])`` against plain FSDP2
  without Join, with even inputs: adjacent pairs of runs in alternating
  order, the median of their ratios (slow drifts of the machine cancel out
  within a pair).
- The time of a shadowed iteration on the rank that ran out, against a
  healthy iteration of the same run.
- The peak growth of the resident memory across the first ``step()`` on
  rank 0 (the one that allocates Adam's state) for the ZeroRedundancyOptimizer
  recipe (20 x Linear(2000, 2000), Adam, 2 ranks): ours, torch's
  ZeroRedundancyOptimizer and plain Adam, each in fresh processes, in both
  ``parameters_as_bucket_view`` modes, as a user would run them.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from benchlib import Figure
from torch.distributed.fsdp import fully_shard

from ddp_join import FSDPJoinable, ZeroRedundancyOptimizer
from join_core import Join
from join_core.testing import run_ranks


def _fsdp_mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()


def _timed(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    joinable: FSDPJoinable,
    data: torch.Tensor,
    steps: int,
    join: bool,
) -> float:
    """Seconds per step; under Join timed inside it: its entry and exit are a cost per Join."""
    dist.barrier()
    if not join:
        start = time.perf_counter()
        _steps(model, optimizer, data, steps)
        return (time.perf_counter() - start) / steps
    with Join([joinable]):
        start = time.perf_counter()
        _steps(model, optimizer, data, steps)
        return (time.perf_counter() - start) / steps


def _fsdp_times(rank: int, world_size: int, pairs: int, steps: int, extra: int) -> dict[str, list[float]]:
    """Per pair: the step time without and with Join and their ratio; then
    per round, a healthy and a shadowed iteration's time."""
    torch.set_num_threads(1)
    model, optimizer = _fsdp_mlp()
    joinable = FSDPJoinable(model, optimizer)
    data = torch.randn(32, 256)
    _timed(model, optimizer, joinable, data, 5, join=False)  # warm-up
    out: dict[str, list[float]] = {"plain": [], "join": [], "ratio": [], "healthy": [], "shadowed": []}
    for pair in range(pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        times = {join: _timed(model, optimizer, joinable, data, steps, join) for join in order}
        out["plain"].append(times[False])
        out["join"].append(times[True])
        out["ratio"].append(times[True] / times[False])
    for _ in range(max(1, pairs // 3)):
        dist.barrier()
        with Join([joinable]):
            start = time.perf_counter()
            _steps(model, optimizer, data, steps)
            healthy = (time.perf_counter() - start) / steps
            if rank == 1:
                _steps(model, optimizer, data, extra)
            start = time.perf_counter()  # rank 0 shadows from here
        out["healthy"].append(healthy)
        out["shadowed"].append((time.perf_counter() - start) / extra)
    return out


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert found is not None, field
    return int(found.group(1))


def _zero_step_peak(rank: int, world_size: int, kind: str, bucket_view: bool, layers: int) -> float:
    """MB the resident memory rose to across the first step() of ``kind``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2000, 2000) for _ in range(layers)])
    optimizer: torch.optim.Optimizer
    if kind == "ours":
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-3
        )
    elif kind == "torch":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script at import
            from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
        optimizer = TorchZero(
            model.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-3
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 2000)).sum().backward()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) starts again from the current resident size
    before = _resident_kib("VmRSS")
    optimizer.step()
    return (_resident_kib("VmHWM") - before) / 1024


def fsdp_figures(rounds: int, quick: bool) -> list[Figure]:
    """The FSDP2 Join figures and the ZeRO memory figures."""
    pairs = 6 if quick else 10 * rounds
    times = run_ranks(_fsdp_times, 2, pairs, 5 if quick else 20, 5 if quick else 20, timeout=1800)[0]
    plain, join = statistics.median(times["plain"]), statistics.median(times["join"])
    overhead = statistics.median(times["ratio"]) - 1
    healthy, shadowed = statistics.median(times["healthy"]), statistics.median(times["shadowed"])
    figures = [
        Figure(
            "FSDP2 step, MLP 256-1024-1024-10: under Join (ours; steps timed inside it) vs plain FSDP2 without Join (torch)",
            "ms/step",
            join * 1e3,
            plain * 1e3,
            "<= 2%",
            overhead * 100,
            overhead <= 0.02,
        ),
        Figure(
            "FSDP2 shadowed iteration (ours) vs a healthy one (torch column)",
            "ms",
            shadowed * 1e3,
            healthy * 1e3,
            "<= 1.1x",
            shadowed / healthy,
            shadowed <= 1.1 * healthy,
        ),
    ]
    layers = 4 if quick else 20
    for bucket_view in (False, True):
        peaks = {
            kind: run_ranks(_zero_step_peak, 2, kind, bucket_view, layers, timeout=600)[0]
            for kind in ("ours", "torch", "adam")
        }
        figures.append(
            Figure(
                f"ZeRO first step peak memory, {layers}x Linear(2000,2000), Adam, "
                f"parameters_as_bucket_view={bucket_view} (plain Adam: {peaks['adam']:.0f} MB)",
                "MB",
                peaks["ours"],
                peaks["torch"],
                "<= torch",
                peaks["torch"] / peaks["ours"],
                peaks["ours"] <= peaks["torch"],
            )
        )
    return figures


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per figure (default 5)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller model")
    args = parser.parse_args(argv)
    figures = fsdp_figures(args.rounds, args.quick)
    print(f"torch {torch.__version__}")
    for f in figures:
        print(
            f"{f.name}\n    {f.unit}: ours {f.ours:.4g}, torch {f.torch:.4g}; goal {f.goal}: {f.ratio:.3g}, "
            f"{'met' if f.met else 'MISSED'}"
        )
    return 0 if all(f.met for f in figures) else 1


if __name__ == "__main__":
    # Through the module's own name, so that the ranks find the rank functions by it.
    sys.exit(importlib.import_module("bench_fsdp")._main(sys.argv[1:]))
