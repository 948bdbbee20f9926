"""Ray actors: the driver calls an actor in a process of its own (``ray`` from PyPI).

    python -m peers.ray_actors --workload pair|ps --launched-at T [--quick]

``ray.init`` starts a local Ray instance (its own daemons besides the
driver and the actor processes); every actor asks for no CPU, so that the
9 of the parameter server fit on 2 cores as the other peers' processes do.
The driver prints the figures.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any, Final

import ray
import torch

from peers.workloads import (
    PAYLOAD,
    PS_TRAINERS,
    PS_WARMUP,
    emit,
    measure_pair,
    ps_calls,
    ps_rate,
    ps_train,
    ps_update,
)

__all__ = ["Echo", "Server", "Trainer"]

_OBJECT_STORE_BYTES: Final = 1 << 30
_TIMEOUT_S: Final = 120.0


class Echo:
    """The callee of the two-process workloads."""

    def noop(self, payload: bytes) -> None:
        """Do nothing."""
        return None

    def echo(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x``."""
        return x


class Server:
    """The parameter server."""

    def update(self, grad: torch.Tensor) -> torch.Tensor:
        """Apply ``grad``; the new parameters."""
        return ps_update(grad)


class Trainer:
    """A trainer: sends its updates to the server."""

    def train(self, server: Any, calls: int) -> tuple[float, float]:
        """``calls`` updates, each waited for; their span."""
        return ps_train(lambda grad: ray.get(server.update.remote(grad), timeout=_TIMEOUT_S), calls)


class _Peer:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def noop(self, payload: bytes) -> None:
        ray.get(self.actor.noop.remote(payload), timeout=_TIMEOUT_S)

    def noop_many(self, payload: bytes, count: int) -> None:
        ray.get([self.actor.noop.remote(payload) for _ in range(count)], timeout=_TIMEOUT_S)

    def echo(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = ray.get(self.actor.echo.remote(x), timeout=_TIMEOUT_S)
        return y


def _actor(cls: type) -> Any:
    return ray.remote(num_cpus=0)(cls).remote()


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workload", required=True, choices=("pair", "ps"))
    parser.add_argument("--launched-at", type=float, required=True, help="time.time() at launch")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report over the network
    ray.init(
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=_OBJECT_STORE_BYTES,
    )
    try:
        if args.workload == "pair":
            peer = _Peer(_actor(Echo))
            peer.noop(PAYLOAD)
            emit(measure_pair(peer, args.quick, args.launched_at, time.time()))
        else:
            server = _actor(Server)
            trainers = [_actor(Trainer) for _ in range(PS_TRAINERS)]
            ray.get([t.train.remote(server, PS_WARMUP) for t in trainers], timeout=_TIMEOUT_S)
            calls = ps_calls(args.quick)
            spans = ray.get([t.train.remote(server, calls) for t in trainers], timeout=_TIMEOUT_S)
            emit({"ps_per_s": ps_rate(spans, calls)})
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    # Through the module's own name, so that the actor processes import the classes by it.
    sys.exit(importlib.import_module("peers.ray_actors")._main(sys.argv[1:]))
