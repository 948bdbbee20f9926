"""Benchmarks on one CUDA device: DDP, FSDP2 under Join and RPC with CUDA tensors.

    python bench/bench_cuda.py [--rounds N] [--out DIR]

Writes ``DIR/results-cuda.md`` (default: this folder). One GPU holds one NCCL
rank (NCCL refuses two ranks on a device), so the DDP and FSDP2 steps run at
world size 1 over NCCL: what they measure is each implementation's own cost
around the step (hooks, buckets, host-device synchronization), not the
network. The RPC figures move CUDA tensors between two processes on the same
device through device maps.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib import Figure
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_join import DistributedDataParallel, FSDPJoinable
from join_core import Join
from join_core.testing import run_ranks

_WIDTH = 2048
_LAYERS = 8


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(_LAYERS):
        layers += [torch.nn.Linear(_WIDTH, _WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device)


def _seconds_per_step(
    model: Any, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: int, join: Any
) -> float:
    def loop() -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()

    torch.cuda.synchronize()
    start = time.perf_counter()
    if join is None:
        loop()
    else:
        with join():
            loop()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _ddp_times(rank: int, world_size: int, batch: int, steps: int, rounds: int) -> dict[str, list[float]]:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    data = torch.randn(batch, _WIDTH, device=device)
    ours = DistributedDataParallel(_model(device), device_ids=[device])
    theirs = TorchDDP(_model(device), device_ids=[device])
    runs: dict[str, tuple[Any, torch.optim.Optimizer, Any]] = {
        "ours": (ours, torch.optim.SGD(ours.parameters(), lr=1e-4), None),
        "ours+join": (ours, torch.optim.SGD(ours.parameters(), lr=1e-4), ours.join),
        "torch": (theirs, torch.optim.SGD(theirs.parameters(), lr=1e-4), None),
        "torch+join": (theirs, torch.optim.SGD(theirs.parameters(), lr=1e-4), theirs.join),
    }
    for model, optimizer, join in runs.values():
        _seconds_per_step(model, optimizer, data, 10, join)  # warm-up
    times: dict[str, list[float]] = {}
    for round_ in range(rounds * 2):
        for key, (model, optimizer, join) in list(runs.items())[:: 1 if round_ % 2 == 0 else -1]:
            times.setdefault(key, []).append(_seconds_per_step(model, optimizer, data, steps, join))
    return times


def _fsdp_times(rank: int, world_size: int, batch: int, steps: int, rounds: int) -> dict[str, list[float]]:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    model = _model(device)
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    joinable = FSDPJoinable(model, optimizer)
    data = torch.randn(batch, _WIDTH, device=device)
    runs = {"plain": None, "join": lambda: Join([joinable])}
    for join in runs.values():
        _seconds_per_step(model, optimizer, data, 5, join)
    times: dict[str, list[float]] = {}
    for round_ in range(rounds * 2):
        for key, join in list(runs.items())[:: 1 if round_ % 2 == 0 else -1]:
            times.setdefault(key, []).append(_seconds_per_step(model, optimizer, data, steps, join))
    return times


def echo(x: torch.Tensor) -> torch.Tensor:
    """The callee's side of the echo: the tensor back, on the device it came to."""
    return x


def _rpc_times(
    rank: int, world_size: int, kind: str, port: int, mib: list[int], calls: int
) -> dict[int, float]:
    torch.cuda.set_device(0)
    peer = f"w{1 - rank}"
    init_method = f"tcp://127.0.0.1:{port}"
    api: Any
    if kind == "torch":
        import torch.distributed.rpc as api

        options: Any = api.TensorPipeRpcBackendOptions(init_method=init_method, device_maps={peer: {0: 0}})
    else:
        import rpc_registry as api
        from tensorpipe_backend import TensorPipeRpcBackendOptions

        options = TensorPipeRpcBackendOptions(init_method=init_method, device_maps={peer: {0: 0}})
    api.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    out: dict[int, float] = {}
    if rank == 0:
        for size in mib:
            x = torch.randn(size * 1024 * 1024 // 4, device="cuda")
            y = api.rpc_sync(peer, echo, args=(x,))
            if not (y.is_cuda and torch.equal(x, y)):
                raise AssertionError(f"{kind}: the echoed CUDA tensor differs from the one sent")
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                y = api.rpc_sync(peer, echo, args=(x,))
            torch.cuda.synchronize()
            out[size] = 2 * size / 1024 / ((time.perf_counter() - start) / calls)  # GB/s both ways
    api.shutdown()
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cuda_figures(rounds: int) -> list[Figure]:
    figures = []
    for batch in (64, 1024):
        times = run_ranks(_ddp_times, 1, batch, 50, rounds, backend="nccl", timeout=600)[0]
        med = {key: statistics.median(values) for key, values in times.items()}
        name = f"DDP step, {_LAYERS}x Linear({_WIDTH},{_WIDTH}), batch {batch}, NCCL, world size 1"
        for suffix, ours, theirs in (
            ("", med["ours"], med["torch"]),
            (", under join", med["ours+join"], med["torch+join"]),
        ):
            figures.append(
                Figure(
                    name + suffix,
                    "ms/step",
                    ours * 1e3,
                    theirs * 1e3,
                    ">= 1.0x",
                    theirs / ours,
                    ours <= theirs,
                )
            )
    times = run_ranks(_fsdp_times, 1, 64, 30, rounds, backend="nccl", timeout=600)[0]
    join, plain = statistics.median(times["join"]), statistics.median(times["plain"])
    overhead = join / plain - 1
    figures.append(
        Figure(
            f"FSDP2 step, {_LAYERS}x Linear({_WIDTH},{_WIDTH}), batch 64: under Join (ours) vs plain FSDP2 (torch)",
            "ms/step",
            join * 1e3,
            plain * 1e3,
            "<= 2%",
            overhead * 100,
            overhead <= 0.02,
        )
    )
    sizes = [1, 64]
    rates: dict[str, list[dict[int, float]]] = {"ours": [], "torch": []}
    for round_ in range(rounds):
        for kind in ("ours", "torch") if round_ % 2 == 0 else ("torch", "ours"):
            rates[kind].append(run_ranks(_rpc_times, 2, kind, _free_port(), sizes, 20, timeout=300)[0])
    for size in sizes:
        ours = statistics.median(r[size] for r in rates["ours"])
        theirs = statistics.median(r[size] for r in rates["torch"])
        figures.append(
            Figure(
                f"rpc_sync echo of a {size} MiB CUDA tensor, device map 0->0, 2 processes on one GPU",
                "GB/s",
                ours,
                theirs,
                ">= 1.0x",
                ours / theirs,
                ours >= theirs,
            )
        )
    return figures


def write_cuda_results(figures: list[Figure], rounds: int, out: Path) -> str:
    """Write ``out``/results-cuda.md; return its text."""
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"Ours vs torch {torch.__version__} on one {props.name} ({os.cpu_count()} cores), "
        f"medians of {rounds} alternating rounds.",
        "",
        "| figure | unit | ours | torch (or reference) | goal | ratio | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        ratio = f"{f.ratio:.2f}x" if f.goal.endswith("x") else f"{f.ratio:+.1f}"
        lines.append(
            f"| {f.name} | {f.unit} | {f.ours:.3g} | {f.torch:.3g} | {f.goal} | {ratio} | {'yes' if f.met else 'NO'} |"
        )
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results-cuda.md").write_text(text)
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here; nothing measured", file=sys.stderr)
        return 2
    figures = cuda_figures(args.rounds)
    print(write_cuda_results(figures, args.rounds, args.out), end="")
    return 0 if all(f.met for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
