"""Benchmarks: ours against torch's own implementation, in one run.

    python3 tools/dev.py bench [--rounds N] [--quick] [--scale] [--two-hosts] [--only SECTIONS]
    python3 tools/dev.py bench --peers [PEERS] [--rounds N] [--quick]

Each figure runs ours and torch's alternately over several rounds inside the
same two processes (127.0.0.1, gloo, CPU), and reports medians. Writes
bench/results.md and bench/results.png, prints the table, and exits 1 if a
goal is missed. Also counts, with torch.profiler, the gloo collectives one
healthy iteration issues with and without Join. The FSDP2 and ZeRO memory
figures come from bench/bench_fsdp.py, the Lightning step (JoinDDPStrategy
against DDPStrategy) from bench/bench_lightning.py.

The second round's figures are measured against limits: our DDP step over
the same step with no communication, DDP at 4 ranks, rpc_sync against a raw
socket round trip in the same processes, a parameter server (8 trainers, with
the ranks in the benchmark's session and each in a session of its own as
torchrun starts them, and 1 trainer for context), and what importing our RPC
packages costs beyond ``import torch`` (bench/bench_import.py).
``--scale`` adds 24 RPC workers on one host (bench/bench_scale.py) and
``--two-hosts`` a 64 MiB echo between two network namespaces (root;
bench/bench_hosts.py). ``--only framing-c`` runs an experiment: rpc_sync
with the framing of small frames compiled from C (bench/bench_framing_c.py).
``uptime`` before and after goes in the results.

``--peers`` runs instead the RPC workloads on ours, torch's RPC, Ray actors
and Monarch actors, each in an environment of its own (bench/peers/),
and writes bench/results-peers.md and bench/results-peers.png; PEERS picks
some of ours,torch,ray,monarch (default all). A peer that cannot install or
run is named in the table with the reason; it never fails the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_continue import continue_figures
from bench_framing_c import framing_c_figures
from bench_fsdp import fsdp_figures
from bench_hosts import two_host_figures
from bench_import import import_figures
from bench_lightning import lightning_figures
from bench_recorder import recorder_figures
from bench_rpc import ps_figures, rpc_figures
from bench_scale import scale_figures
from bench_shadow import shadow_figures
from benchlib import Figure, cost_script_runs, write_results
from peers import report as peers_report
from peers.runner import PEERS, run_peers
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_join import DistributedDataParallel
from join_core.testing import run_ranks

ROOT = Path(__file__).resolve().parent.parent


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 16)


def _trainer(kind: str, make: Callable[[], torch.nn.Module]) -> tuple[Any, torch.optim.Optimizer]:
    model: Any = DistributedDataParallel(make()) if kind == "ours" else TorchDDP(make())
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _timed_steps(
    model: Any, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: int, join: bool
) -> float:
    def loop() -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()

    dist.barrier()
    start = time.perf_counter()
    if join:
        with model.join():
            loop()
    else:
        loop()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _step_times(rank: int, world_size: int, model_name: str, batch: int, steps: int, rounds: int) -> Any:
    """Seconds per step for ours and torch's, with and without join, per round."""
    torch.set_num_threads(1)
    make = _mlp if model_name == "mlp" else _tiny
    features = 256 if model_name == "mlp" else 16
    data = torch.randn(batch, features)
    trainers = {kind: _trainer(kind, make) for kind in ("ours", "torch")}
    for model, optimizer in trainers.values():
        _timed_steps(model, optimizer, data, 5, join=False)  # warm-up
    times: dict[str, list[float]] = {}
    for round_ in range(rounds * 2):
        # Alternate which goes first, so neither profits from running second.
        kinds = list(trainers.items())[:: 1 if round_ % 2 == 0 else -1]
        for kind, (model, optimizer) in kinds:
            for join in (False, True) if round_ % 2 == 0 else (True, False):
                key = f"{kind}{'+join' if join else ''}"
                times.setdefault(key, []).append(_timed_steps(model, optimizer, data, steps // 2, join))
    return times


def _overlap(rank: int, world_size: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of our DDP on the MLP, and of the same model with no communication at
    all: rank 0 alone (the other ranks wait in a barrier), same batch and one thread."""
    torch.set_num_threads(1)
    data = torch.randn(32, 256)
    model, optimizer = _trainer("ours", _mlp)
    local = _mlp()
    local_optimizer = torch.optim.SGD(local.parameters(), lr=0.01)

    def local_steps(count: int) -> float:
        dist.barrier()
        elapsed = 0.0
        if rank == 0:
            start = time.perf_counter()
            for _ in range(count):
                local_optimizer.zero_grad()
                local(data).pow(2).mean().backward()
                local_optimizer.step()
            elapsed = (time.perf_counter() - start) / count
        dist.barrier()
        return elapsed

    _timed_steps(model, optimizer, data, 5, join=False)  # warm-up
    local_steps(5)
    times: dict[str, list[float]] = {"ddp": [], "local": []}
    for round_ in range(rounds * 2):
        for kind in ("ddp", "local") if round_ % 2 == 0 else ("local", "ddp"):
            if kind == "ddp":
                times[kind].append(_timed_steps(model, optimizer, data, steps, join=False))
            else:
                times[kind].append(local_steps(steps))
    return times


# One process on torch's fake backend (collectives that do nothing, so nothing else varies),
# in a world of one (the heartbeat's sum is then that of a healthy world): our DDP's step on
# Linear(16, 16) inside a Join and without one, in adjacent pairs; what the Join adds per step.
_JOIN_COST_SCRIPT = """
import json, statistics, time, torch, torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=1)
torch.set_num_threads(1)
from ddp_join import DistributedDataParallel
model = DistributedDataParallel(torch.nn.Linear(16, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(8, 16)
def loop(n):
    start = time.perf_counter()
    for _ in range(n):
        optimizer.zero_grad(); model(data).pow(2).mean().backward(); optimizer.step()
    return (time.perf_counter() - start) / n
def steps(n, join):
    if not join:
        return loop(n)
    with model.join():
        return loop(n)
steps(50, False); steps(50, True)
added = []
for pair in range(40):
    times = {}
    for join in ((True, False) if pair % 2 == 0 else (False, True)):
        times[join] = steps(300, join)
    added.append(times[True] - times[False])
print(json.dumps({"added": statistics.median(added)}))
"""


def _join_overhead(rank: int, world_size: int, pairs: int, steps: int) -> dict[str, list[float]]:
    """Per kind, the ratio of ``steps`` steps inside a Join to as many without one next to
    them, for ``pairs`` adjacent pairs in alternating order (slow drifts of the machine cancel
    out within a pair); and, as ``<kind> entry and exit``, the seconds of the Join's own entry
    and exit around those steps, timed apart: a cost per Join, not per step."""
    torch.set_num_threads(1)
    data = torch.randn(8, 16)
    trainers = {kind: _trainer(kind, _tiny) for kind in ("ours", "torch")}
    for model, optimizer in trainers.values():
        _timed_steps(model, optimizer, data, 20, join=False)  # warm-up
    out: dict[str, list[float]] = {}

    def loop(model: Any, optimizer: torch.optim.Optimizer) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()

    for pair in range(pairs):
        for kind, (model, optimizer) in trainers.items():
            times: dict[bool, float] = {}
            for join in (False, True) if pair % 2 == 0 else (True, False):
                dist.barrier()
                start = time.perf_counter()
                if join:
                    with model.join():
                        entered = time.perf_counter()
                        loop(model, optimizer)
                        looped = time.perf_counter()
                    edges = entered - start + time.perf_counter() - looped
                    out.setdefault(f"{kind} entry and exit", []).append(edges)
                    times[join] = looped - entered
                else:
                    loop(model, optimizer)
                    times[join] = time.perf_counter() - start
            out.setdefault(kind, []).append(times[True] / times[False])
    return out


def _uneven_tail(rank: int, world_size: int, steps: int, extra: int, rounds: int) -> Any:
    """Seconds per shadowed iteration on the rank that runs out first."""
    torch.set_num_threads(1)
    data = torch.randn(32, 256)
    trainers = {kind: _trainer(kind, _mlp) for kind in ("ours", "torch")}
    times: dict[str, list[float]] = {}
    for round_ in range(-1, rounds):  # round -1 warms up, as the other figures do
        for kind, (model, optimizer) in list(trainers.items())[:: 1 if round_ % 2 == 0 else -1]:
            join = model.join()
            dist.barrier()
            with join:
                for _ in range(steps + (extra if rank == 1 else 0)):
                    optimizer.zero_grad()
                    model(data).pow(2).mean().backward()
                    optimizer.step()
                start = time.perf_counter()  # rank 0 shadows from here
            tail = time.perf_counter() - start
            if round_ >= 0:
                times.setdefault(kind, []).append(tail / extra)
    return times


def _collectives(rank: int, world_size: int) -> dict[str, int]:
    """gloo collectives of 5 healthy iterations on Linear(16, 16)."""
    from torch.profiler import ProfilerActivity, profile

    data = torch.randn(8, 16)
    counts = {}
    for kind in ("ours", "torch"):
        model, optimizer = _trainer(kind, _tiny)
        for join in (False, True):
            context: Any = model.join() if join else _Null()
            with context:
                model(data).sum().backward()  # warm-up, not counted
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        optimizer.zero_grad()
                        model(data).pow(2).mean().backward()
                        optimizer.step()
            counts[f"{kind}{'+join' if join else ''}"] = sum(
                1 for event in prof.events() if event.name.startswith("gloo:")
            )
    return counts


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _median(values: list[float]) -> float:
    return statistics.median(values)


def ddp_figures(rounds: int, quick: bool) -> list[Figure]:
    figures = []
    for name, model_name, batch, steps in (
        ("DDP step, MLP 256-1024-1024-10, batch 32", "mlp", 32, 10 if quick else 30),
        ("DDP step, Linear(16,16), batch 8", "tiny", 8, 50 if quick else 300),
    ):
        times = run_ranks(_step_times, 2, model_name, batch, steps, rounds, timeout=900)[0]
        ours, theirs = _median(times["ours"]), _median(times["torch"])
        figures.append(
            Figure(name, "ms/step", ours * 1e3, theirs * 1e3, ">= 1.0x", theirs / ours, ours <= theirs)
        )
        if model_name == "tiny":
            ratios = run_ranks(_join_overhead, 2, 10 if quick else 30, 50 if quick else 100, timeout=900)[0]
            join_ours = _median(ratios["ours"]) - 1
            join_torch = _median(ratios["torch"]) - 1
            edges_ours, edges_torch = (_median(ratios[f"{k} entry and exit"]) for k in ("ours", "torch"))
            added = _median([run["added"] for run in cost_script_runs(_JOIN_COST_SCRIPT, "Join's cost")])
            figures += [
                Figure(
                    "Join overhead per step, Linear(16,16): time Join adds to a step (one process, "
                    "fake backend) / step time",
                    "% of the step",
                    added / ours * 100,
                    float("nan"),
                    "<= 1%",
                    added / ours * 100,
                    added <= 0.01 * ours,
                    f"{added * 1e6:.1f} us added",
                ),
                Figure(
                    "  Join overhead per step timed, 2 ranks, steps timed inside the Join",
                    "% over no join",
                    join_ours * 100,
                    join_torch * 100,
                    "(context)",
                    float("nan"),
                    True,
                ),
                Figure(
                    "Join entry and exit around those steps, Linear(16,16): a cost per Join",
                    "ms",
                    edges_ours * 1e3,
                    edges_torch * 1e3,
                    "(context)",
                    edges_ours / edges_torch,
                    True,
                ),
            ]
    tail = run_ranks(_uneven_tail, 2, 5, 10 if quick else 30, rounds, timeout=900)[0]
    ours, theirs = _median(tail["ours"]), _median(tail["torch"])
    figures.append(
        Figure(
            "uneven tail: time per shadowed iteration",
            "ms",
            ours * 1e3,
            theirs * 1e3,
            "<= torch",
            theirs / ours,
            ours <= theirs,
        )
    )
    counts = run_ranks(_collectives, 2, timeout=300)[0]
    extra_ours = (counts["ours+join"] - counts["ours"]) / 5
    extra_torch = (counts["torch+join"] - counts["torch"]) / 5
    figures.append(
        Figure(
            "extra collectives per healthy iteration under join",
            "gloo ops",
            extra_ours,
            extra_torch,
            "0 extra",
            extra_ours,
            extra_ours <= 0,
        )
    )
    figures += shadow_figures(rounds, quick)
    figures += recorder_figures(rounds, quick)
    return figures


def round_two_ddp_figures(rounds: int, quick: bool) -> list[Figure]:
    """Our DDP step over the same step without communication, and DDP at 4 ranks against torch's."""
    steps = 10 if quick else 30
    times = run_ranks(_overlap, 2, steps, rounds, timeout=900)[0]
    ddp, local = _median(times["ddp"]), _median(times["local"])
    figures = [
        Figure(
            "DDP overlap: our step / no-communication step, MLP, batch 32",
            "ms/step",
            ddp * 1e3,
            local * 1e3,
            "<= 1.10x",
            ddp / local,
            ddp <= 1.10 * local,
            reference="no comm.",
        )
    ]
    times = run_ranks(_step_times, 4, "mlp", 32, steps, rounds, timeout=1800)[0]
    ours, theirs = _median(times["ours"]), _median(times["torch"])
    figures.append(
        Figure(
            "DDP step at 4 ranks, MLP, batch 32",
            "ms/step",
            ours * 1e3,
            theirs * 1e3,
            ">= 1.0x",
            theirs / ours,
            ours <= theirs,
        )
    )
    return figures


SECTIONS: dict[str, Callable[[int, bool], list[Figure]]] = {
    "ddp": ddp_figures,
    "continue": continue_figures,
    "fsdp": fsdp_figures,
    "overlap": round_two_ddp_figures,
    "lightning": lightning_figures,
    "rpc": rpc_figures,
    "ps": ps_figures,
    "import": import_figures,
    "scale": lambda rounds, quick: scale_figures(),
    "two-hosts": two_host_figures,
    "framing-c": framing_c_figures,
}


def _uptime() -> str:
    with open("/proc/loadavg") as loadavg:
        return "load average " + ", ".join(loadavg.read().split()[:3])


def _peers(keys: list[str], rounds: int, quick: bool) -> int:
    """The peers' benchmark: written to bench/results-peers.md; 0 however the peers fared."""
    load = [_uptime()]
    outcomes = run_peers(keys, rounds, quick)
    load.append(_uptime())
    print(peers_report.write(outcomes, rounds, quick, load, ROOT / "bench"))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per figure (default 5)")
    parser.add_argument("--quick", action="store_true", help="fewer steps per round, for a smoke run")
    parser.add_argument("--ddp-only", action="store_true", help="skip the RPC figures")
    parser.add_argument("--scale", action="store_true", help="add RPC at scale: 24 workers on one host")
    parser.add_argument(
        "--two-hosts", action="store_true", help="add the echo between two network namespaces (root)"
    )
    parser.add_argument(
        "--only",
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all but scale, two-hosts, framing-c)",
    )
    parser.add_argument(
        "--peers",
        nargs="?",
        const=",".join(spec.key for spec in PEERS),
        help="run the peers' benchmark instead: comma-separated, of "
        f"{','.join(spec.key for spec in PEERS)} (default all)",
    )
    args = parser.parse_args(argv)
    if args.peers is not None:
        keys = args.peers.split(",")
        unknown = [key for key in keys if key not in {spec.key for spec in PEERS}]
        if unknown:
            parser.error(f"--peers: unknown peers {unknown}; choose from {','.join(s.key for s in PEERS)}")
        return _peers(keys, args.rounds, args.quick)
    if args.only:
        sections = args.only.split(",")
        unknown = [s for s in sections if s not in SECTIONS]
        if unknown:
            parser.error(f"--only: unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    else:
        sections = ["ddp", "continue", "fsdp", "overlap", "lightning"] + (
            [] if args.ddp_only else ["rpc", "ps", "import"]
        )
        sections += (["scale"] if args.scale else []) + (["two-hosts"] if args.two_hosts else [])
    load = [_uptime()]
    figures = [f for section in sections for f in SECTIONS[section](args.rounds, args.quick)]
    load.append(_uptime())
    table = write_results(figures, args.rounds, ROOT / "bench", load)
    print(table)
    missed = [f.name for f in figures if not f.met]
    if missed:
        print("goals missed: " + "; ".join(missed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
