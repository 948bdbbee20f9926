"""RPC benchmarks: ``rpc_registry`` on the TENSORPIPE backend against torch's own RPC agent.

    PYTHONPATH=packages/join-core/src:packages/rpc-registry/src:packages/tensorpipe-backend/src:tools \
        python tools/bench_rpc.py [--rounds N] [--quick]

Every round starts two fresh processes (127.0.0.1, CPU) for each stack, ours
and torch's in alternating order, and measures in each what
``/work/shared/anchors/rpc_bench.py`` measures for torch: the ``init_rpc`` time
of rank 0, the mean ``rpc_sync`` no-op round trip after 200 warm-up calls,
the throughput of 2000 ``rpc_async`` no-ops issued then waited for, and the
bytes both ways per second of ``rpc_sync(echo, x)`` with a 64 MiB tensor.
Figures are medians over the rounds. As ``timeit`` does, each timed section
starts after a ``gc.collect()`` (both stacks): otherwise the first one to
allocate enough objects pays for the full collection of what importing torch
left behind (about 0.1 s here, once per process).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import socket
import statistics
import sys
import time
from typing import Any, Final

import torch
from benchlib import Figure

from join_core.testing import run_ranks

__all__ = ["echo", "noop", "rpc_figures"]

_ECHO_MIB: Final = 64
_SYNC_CALLS: Final = 2000
_ASYNC_CALLS: Final = 2000
_WARMUP: Final = 200
_NUM_WORKER_THREADS: Final = 16


def noop() -> None:
    """The no-op the callee runs."""
    return None


def echo(x: torch.Tensor) -> torch.Tensor:
    """Return ``x``: the callee's side of the tensor echo."""
    return x


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _measure(rank: int, world_size: int, kind: str, port: int, quick: bool) -> dict[str, float]:
    """One stack's figures in one fresh process pair; rank 0 returns them."""
    init_method = f"tcp://127.0.0.1:{port}"
    api: Any
    if kind == "torch":
        import torch.distributed.rpc as api

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        options: Any = api.TensorPipeRpcBackendOptions(
            num_worker_threads=_NUM_WORKER_THREADS, init_method=init_method
        )
    else:
        import rpc_registry as api
        from tensorpipe_backend import TensorPipeRpcBackendOptions

        options = TensorPipeRpcBackendOptions(num_worker_threads=_NUM_WORKER_THREADS, init_method=init_method)
    start = time.perf_counter()
    api.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    out = {"init": time.perf_counter() - start}
    if rank == 0:
        sync_calls = _SYNC_CALLS // 4 if quick else _SYNC_CALLS
        for _ in range(_WARMUP):
            api.rpc_sync("w1", noop)
        gc.collect()
        start = time.perf_counter()
        for _ in range(sync_calls):
            api.rpc_sync("w1", noop)
        out["sync_us"] = (time.perf_counter() - start) / sync_calls * 1e6
        gc.collect()
        start = time.perf_counter()
        futures = [api.rpc_async("w1", noop) for _ in range(_ASYNC_CALLS)]
        torch.futures.wait_all(futures)
        out["async_per_s"] = _ASYNC_CALLS / (time.perf_counter() - start)
        x = torch.randn(_ECHO_MIB * 1024 * 1024 // 4)
        y = api.rpc_sync("w1", echo, args=(x,))
        if not torch.equal(x, y):
            raise AssertionError(f"{kind}: the echoed tensor differs from the one sent")
        echoes = 3 if quick else 10
        gc.collect()
        start = time.perf_counter()
        for _ in range(echoes):
            y = api.rpc_sync("w1", echo, args=(x,))
        per_echo = (time.perf_counter() - start) / echoes
        out["echo_gb_s"] = 2 * _ECHO_MIB / per_echo / 1024
    api.shutdown()
    return out


def rpc_figures(rounds: int, quick: bool) -> list[Figure]:
    """The four RPC figures, medians over ``rounds`` rounds of ours and torch's, alternating."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1 round")
    samples: dict[str, dict[str, list[float]]] = {"ours": {}, "torch": {}}
    for round_ in range(rounds):
        order = ("ours", "torch") if round_ % 2 == 0 else ("torch", "ours")
        for kind in order:
            result = run_ranks(_measure, 2, kind, _free_port(), quick, timeout=300)[0]
            for key, value in result.items():
                samples[kind].setdefault(key, []).append(value)

    def median(kind: str, key: str) -> float:
        return statistics.median(samples[kind][key])

    figures = []
    for name, unit, key, lower_is_better in (
        ("rpc_sync no-op round trip", "us", "sync_us", True),
        ("rpc_async no-op throughput", "calls/s", "async_per_s", False),
        (f"{_ECHO_MIB} MiB tensor echo", "GB/s", "echo_gb_s", False),
        ("init_rpc, 2 workers", "s", "init", True),
    ):
        ours, theirs = median("ours", key), median("torch", key)
        if lower_is_better:
            ratio = theirs / ours
            goal, met = "<= 0.5x", ours <= 0.5 * theirs
        else:
            ratio = ours / theirs
            goal, met = ">= 2x", ours >= 2 * theirs
        figures.append(Figure(name, unit, ours, theirs, goal, ratio, met))
    return figures


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per stack (default 5)")
    parser.add_argument("--quick", action="store_true", help="fewer calls per round")
    args = parser.parse_args(argv)
    figures = rpc_figures(args.rounds, args.quick)
    print(f"medians of {args.rounds} rounds, torch {torch.__version__}")
    print(f"{'figure':<30} {'unit':<8} {'ours':>10} {'torch':>10} {'goal':>8} {'ratio':>7}  met")
    for f in figures:
        print(
            f"{f.name:<30} {f.unit:<8} {f.ours:>10.4g} {f.torch:>10.4g} {f.goal:>8} "
            f"{f.ratio:>6.2f}x  {'yes' if f.met else 'NO'}"
        )
    return 0 if all(f.met for f in figures) else 1


if __name__ == "__main__":
    # Through the module's own name, so that the ranks find _measure, noop and echo by it.
    sys.exit(importlib.import_module("bench_rpc")._main(sys.argv[1:]))
