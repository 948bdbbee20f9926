"""RPC at scale: many workers on one host, ours against torch's agent where it starts.

    PYTHONPATH=packages/join-core/src:packages/rpc-registry/src:packages/tensorpipe-backend/src:bench \
        python bench/bench_scale.py [--workers N]

All workers start ``init_rpc`` together (after a barrier) and each then calls
``rpc_sync`` on every other worker, in rank order starting after its own.
Each worker counts its open file descriptors (``/proc/self/fd``) before
``init_rpc``, after it, and after its calls; the figures are the increases,
medians over the workers other than rank 0 (rank 0 also hosts the
rendezvous store and hears from everyone in the group's rounds). A second,
small group (4 workers) gives the count after ``init_rpc`` that a larger
world must not exceed: descriptors should grow with the peers a worker
talks to, not with the world. torch's agent is known to fail past about
18-20 workers on one host (pytorch#85607, tensorpipe#397): its run gets a
time limit, and its figures are left empty when it fails.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import os
import statistics
import sys
import time
from typing import Any, Final

import torch.distributed as dist
from bench_rpc import _free_port, noop
from benchlib import Figure

from join_core.testing import RanksFailedError, run_ranks

__all__ = ["scale_figures"]

_WORKERS: Final = 24
_SMALL: Final = 4
_INIT_GOAL_S: Final = 5.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _scale(rank: int, world_size: int, kind: str, port: int) -> dict[str, float]:
    """One worker's init time, calls completed and descriptor counts."""
    init_method = f"tcp://127.0.0.1:{port}"
    api: Any
    if kind == "torch":
        import torch.distributed.rpc as api

        options: Any = api.TensorPipeRpcBackendOptions(num_worker_threads=4, init_method=init_method)
    else:
        import rpc_registry as api
        from tensorpipe_backend import TensorPipeRpcBackendOptions

        options = TensorPipeRpcBackendOptions(num_worker_threads=4, init_method=init_method)
    gc.collect()
    before = _fds()
    dist.barrier()
    start = time.perf_counter()
    api.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    out = {"init_s": time.perf_counter() - start, "fds_init": float(_fds() - before)}
    completed = 0
    for offset in range(1, world_size):
        peer = (rank + offset) % world_size
        try:
            api.rpc_sync(f"w{peer}", noop)
            completed += 1
        except (RuntimeError, OSError, TimeoutError):  # a failed call is what this counts
            pass
    out["calls"] = float(completed)
    out["fds_calls"] = float(_fds() - before)
    api.shutdown()
    return out


def _run(kind: str, workers: int, timeout: float) -> list[dict[str, float]] | str:
    try:
        return run_ranks(_scale, workers, kind, _free_port(), timeout=timeout)
    except RanksFailedError as exc:
        return str(exc).splitlines()[0][:200]


def _others(results: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in results[1:])


def scale_figures(workers: int = _WORKERS, torch_timeout: float = 240.0) -> list[Figure]:
    """init time, calls completed and descriptors at ``workers`` workers; see the module docstring."""
    small = _run("ours", _SMALL, 300)
    ours = _run("ours", workers, 900)
    theirs = _run("torch", workers, torch_timeout)
    if isinstance(small, str) or isinstance(ours, str):
        raise RuntimeError(f"our agent failed at scale: {small if isinstance(small, str) else ours}")
    if isinstance(theirs, str):
        print(f"torch's agent at {workers} workers: {theirs}")
    nan = math.nan
    pairs = workers * (workers - 1)

    def torch_value(fn: Any) -> float:
        return nan if isinstance(theirs, str) else float(fn(theirs))

    init = max(r["init_s"] for r in ours)
    calls = sum(r["calls"] for r in ours)
    fds_init, fds_small = _others(ours, "fds_init"), _others(small, "fds_init")
    fds_calls = _others(ours, "fds_calls")
    return [
        Figure(
            f"RPC at scale: init_rpc, {workers} workers on one host (slowest)",
            "s",
            init,
            torch_value(lambda rs: max(r["init_s"] for r in rs)),
            f"<= {_INIT_GOAL_S:g} s",
            init,
            init <= _INIT_GOAL_S,
        ),
        Figure(
            f"RPC at scale: all-pairs rpc_sync completed, {workers} workers",
            "calls",
            calls,
            torch_value(lambda rs: sum(r["calls"] for r in rs)),
            f"all {pairs}",
            calls / pairs,
            calls == pairs,
        ),
        Figure(
            f"RPC at scale: fds per worker after init_rpc, {workers} workers (vs {_SMALL} workers)",
            "fds",
            fds_init,
            fds_small,
            f"<= {_SMALL}-worker count",
            fds_init - fds_small,
            fds_init <= fds_small,
            reference=f"ours, {_SMALL} workers",
        ),
        Figure(
            f"RPC at scale: fds per worker after calling all {workers - 1} peers",
            "fds",
            fds_calls,
            torch_value(lambda rs: _others(rs, "fds_calls")),
            "(grows with peers)",
            (fds_calls - fds_init) / (workers - 2),
            True,
        ),
    ]


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workers", type=int, default=_WORKERS, help=f"workers (default {_WORKERS})")
    args = parser.parse_args(argv)
    for f in scale_figures(args.workers):
        print(f)
    return 0


if __name__ == "__main__":
    # Through the module's own name, so that the ranks find _scale by it.
    sys.exit(importlib.import_module("bench_scale")._main(sys.argv[1:]))
