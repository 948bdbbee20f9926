"""Monarch actors: the driver calls an actor in a process of its own (``torchmonarch`` from PyPI).

    python -m peers.monarch_actors --workload pair|ps --launched-at T [--quick]

The driver spawns the actors' processes on this host (``this_host().spawn_procs``):
one for the echo actor, or one for the parameter server and 8 for the
trainers. The driver prints the figures.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Any, Final

import torch
from monarch.actor import Actor, endpoint, this_host

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

_TIMEOUT_S: Final = 120.0


class Echo(Actor):  # type: ignore[misc]  # monarch ships no type information for Actor
    """The callee of the two-process workloads."""

    @endpoint  # type: ignore[untyped-decorator]
    def noop(self, payload: bytes) -> None:
        """Do nothing."""
        return None

    @endpoint  # type: ignore[untyped-decorator]
    def echo(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x``."""
        return x


class Server(Actor):  # type: ignore[misc]
    """The parameter server."""

    @endpoint  # type: ignore[untyped-decorator]
    def update(self, grad: torch.Tensor) -> torch.Tensor:
        """Apply ``grad``; the new parameters."""
        return ps_update(grad)


class Trainer(Actor):  # type: ignore[misc]
    """A trainer: sends its updates to the server."""

    @endpoint  # type: ignore[untyped-decorator]
    def train(self, server: Any, calls: int) -> tuple[float, float]:
        """``calls`` updates, each waited for; their span."""
        return ps_train(lambda grad: server.update.call_one(grad).get(timeout=_TIMEOUT_S), calls)


class _Peer:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def noop(self, payload: bytes) -> None:
        self.actor.noop.call_one(payload).get(timeout=_TIMEOUT_S)

    def noop_many(self, payload: bytes, count: int) -> None:
        futures = [self.actor.noop.call_one(payload) for _ in range(count)]
        for future in futures:
            future.get(timeout=_TIMEOUT_S)

    def echo(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.actor.echo.call_one(x).get(timeout=_TIMEOUT_S)
        return y


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--workload", required=True, choices=("pair", "ps"))
    parser.add_argument("--launched-at", type=float, required=True, help="time.time() at launch")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    meshes = []
    try:
        if args.workload == "pair":
            meshes.append(this_host().spawn_procs(per_host={"procs": 1}))
            peer = _Peer(meshes[0].spawn("echo", Echo))
            peer.noop(PAYLOAD)
            emit(measure_pair(peer, args.quick, args.launched_at, time.time()))
        else:
            meshes.append(this_host().spawn_procs(per_host={"procs": 1}))
            server = meshes[0].spawn("server", Server)
            meshes.append(this_host().spawn_procs(per_host={"procs": PS_TRAINERS}))
            trainers = meshes[1].spawn("trainer", Trainer)
            trainers.train.call(server, PS_WARMUP).get(timeout=_TIMEOUT_S)
            calls = ps_calls(args.quick)
            spans = list(trainers.train.call(server, calls).get(timeout=_TIMEOUT_S).values())
            emit({"ps_per_s": ps_rate(spans, calls)})
    finally:
        for mesh in meshes:
            mesh.stop().get(timeout=_TIMEOUT_S)
    return 0


if __name__ == "__main__":
    # Through the module's own name, so that the actor processes import the classes by it.
    sys.exit(importlib.import_module("peers.monarch_actors")._main(sys.argv[1:]))
