"""Ours (``rpc_registry`` on ``tensorpipe_backend``) and torch's ``torch.distributed.rpc``:
one worker for both, as the two share torch's API.

    python -m peers.rpc_api --stack ours|torch --rank R --world-size N --port P \\
        --workload pair|ps --launched-at T [--quick]

The runner starts every rank. ``pair``: 2 ranks, rank 0 calls rank 1.
``ps``: rank 0 is the parameter server and also tells the 8 trainers (ranks
1-8) when to run, as a driver would. Rank 0 prints the figures.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any, Final

import torch

from peers.workloads import (
    PAYLOAD,
    PS_WARMUP,
    emit,
    measure_pair,
    ps_calls,
    ps_rate,
    ps_train,
    ps_update,
)

__all__ = ["echo", "noop", "train"]

_NUM_WORKER_THREADS: Final = 16
_TIMEOUT_S: Final = 120.0


def noop(payload: bytes) -> None:
    """The callee's no-op."""
    return None


def echo(x: torch.Tensor) -> torch.Tensor:
    """The callee's side of the tensor echo."""
    return x


def train(calls: int) -> tuple[float, float]:
    """A trainer's run, started by rank 0: ``calls`` updates sent to the server ``w0``."""
    api = _api  # set before init_rpc: rank 0 may call in before this rank's init_rpc returns
    return ps_train(lambda grad: api.rpc_sync("w0", ps_update, args=(grad,), timeout=_TIMEOUT_S), calls)


_api: Any = None


class _Peer:
    def __init__(self, api: Any) -> None:
        self.api = api

    def noop(self, payload: bytes) -> None:
        self.api.rpc_sync("w1", noop, args=(payload,), timeout=_TIMEOUT_S)

    def noop_many(self, payload: bytes, count: int) -> None:
        futures = [self.api.rpc_async("w1", noop, args=(payload,), timeout=_TIMEOUT_S) for _ in range(count)]
        for future in futures:
            future.wait()

    def echo(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.api.rpc_sync("w1", echo, args=(x,), timeout=_TIMEOUT_S)
        return y


def _init(stack: str, rank: int, world_size: int, port: int) -> Any:
    global _api
    init_method = f"tcp://127.0.0.1:{port}"
    api: Any
    if stack == "torch":
        import torch.distributed.rpc as api

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        options: Any = api.TensorPipeRpcBackendOptions(
            num_worker_threads=_NUM_WORKER_THREADS, init_method=init_method, rpc_timeout=_TIMEOUT_S
        )
    elif stack == "ours":
        import rpc_registry as api
        from tensorpipe_backend import TensorPipeRpcBackendOptions

        options = TensorPipeRpcBackendOptions(
            num_worker_threads=_NUM_WORKER_THREADS, init_method=init_method, rpc_timeout=_TIMEOUT_S
        )
    else:
        raise ValueError(f"--stack {stack!r}: expected 'ours' or 'torch'")
    _api = api
    api.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    return api


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--stack", required=True, choices=("ours", "torch"))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workload", required=True, choices=("pair", "ps"))
    parser.add_argument("--launched-at", type=float, required=True, help="time.time() at launch")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    api = _init(args.stack, args.rank, args.world_size, args.port)
    if args.rank == 0 and args.workload == "pair":
        peer = _Peer(api)
        peer.noop(PAYLOAD)
        emit(measure_pair(peer, args.quick, args.launched_at, time.time()))
    elif args.rank == 0:
        trainers = [f"w{rank}" for rank in range(1, args.world_size)]
        warmups = [api.rpc_async(name, train, args=(PS_WARMUP,), timeout=_TIMEOUT_S) for name in trainers]
        for future in warmups:  # all done before any trainer is timed
            future.wait()
        calls = ps_calls(args.quick)
        futures = [api.rpc_async(name, train, args=(calls,), timeout=_TIMEOUT_S) for name in trainers]
        emit({"ps_per_s": ps_rate([future.wait() for future in futures], calls)})
    api.shutdown()
    return 0


if __name__ == "__main__":
    # Through the module's own name, so that the ranks find noop, echo and train by it.
    sys.exit(importlib.import_module("peers.rpc_api")._main(sys.argv[1:]))
