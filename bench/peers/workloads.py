"""The workloads every peer runs, written once against a small adapter.

Imported inside each peer's own environment, so it needs nothing but the
standard library and torch. A peer's worker implements :class:`Peer` (a
no-op call with a 64-byte argument, a batch of such calls in flight at once,
a tensor echo) and hands it to :func:`measure_pair`; the parameter server
times its trainers with :func:`ps_rate`. The figures go back to the runner
as one line of JSON on standard output (:func:`emit`).
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

import torch

__all__ = [
    "ASYNC_CALLS",
    "ECHO_MIB",
    "PAYLOAD",
    "PS_MIB",
    "PS_TRAINERS",
    "PS_WARMUP",
    "RESULT_PREFIX",
    "Peer",
    "emit",
    "measure_pair",
    "ps_calls",
    "ps_rate",
    "ps_train",
    "ps_update",
]

#: The no-op's argument: 64 bytes.
PAYLOAD: Final = b"\x2a" * 64
ASYNC_CALLS: Final = 2000
ECHO_MIB: Final = (1, 64)
PS_TRAINERS: Final = 8
PS_MIB: Final = 1
PS_WARMUP: Final = 10
#: The runner takes the line that starts with this as the worker's figures.
RESULT_PREFIX: Final = "PEER-RESULT "

_WARMUP: Final = 200


class Peer(Protocol):
    """What a peer's worker offers the workloads: calls into the other process."""

    def noop(self, payload: bytes) -> None:
        """One no-op call with ``payload``, waited for."""

    def noop_many(self, payload: bytes, count: int) -> None:
        """``count`` no-op calls issued at once, then all waited for."""

    def echo(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` sent to the other process and back."""


def measure_pair(peer: Peer, quick: bool, launched_at: float, first_call_at: float) -> dict[str, float]:
    """Every two-process figure of ``peer``; ``launched_at`` and ``first_call_at`` are
    ``time.time()`` when the runner started the processes and when the first call completed."""
    out = {"startup_s": first_call_at - launched_at}
    for _ in range(_WARMUP // 4 if quick else _WARMUP):
        peer.noop(PAYLOAD)
    calls = 500 if quick else 2000
    latencies = []
    gc.collect()
    for _ in range(calls):
        start = time.perf_counter()
        peer.noop(PAYLOAD)
        latencies.append(time.perf_counter() - start)
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    out["sync_p50_us"] = statistics.median(latencies) * 1e6
    out["sync_p99_us"] = cuts[98] * 1e6
    count = ASYNC_CALLS // 4 if quick else ASYNC_CALLS
    peer.noop_many(PAYLOAD, count // 10)  # warm-up
    gc.collect()
    start = time.perf_counter()
    peer.noop_many(PAYLOAD, count)
    out["async_per_s"] = count / (time.perf_counter() - start)
    for mib in ECHO_MIB:
        x = torch.randn(mib * 1024 * 1024 // 4)
        if not torch.equal(peer.echo(x), x):
            raise AssertionError(f"the {mib} MiB tensor came back changed")
        echoes = (3 if quick else 10) if mib > 1 else (10 if quick else 50)
        gc.collect()
        start = time.perf_counter()
        for _ in range(echoes):
            peer.echo(x)
        out[f"echo{mib}_gb_s"] = 2 * mib * echoes / (time.perf_counter() - start) / 1024
    return out


_ps_lock = threading.Lock()
_ps_param: list[torch.Tensor] = []


def ps_update(grad: torch.Tensor) -> torch.Tensor:
    """The server's side of a parameter-server step: apply ``grad``, return the new parameters."""
    with _ps_lock:
        if not _ps_param:
            _ps_param.append(torch.zeros_like(grad))
        _ps_param[0].add_(grad, alpha=-0.01)
        return _ps_param[0].clone()


def ps_train(update: Callable[[torch.Tensor], torch.Tensor], calls: int) -> tuple[float, float]:
    """A trainer's side: ``calls`` updates of a 1 MiB gradient, each waited for; the
    ``time.time()`` span they took."""
    grad = torch.randn(PS_MIB * 1024 * 1024 // 4)
    gc.collect()
    start = time.time()
    for _ in range(calls):
        update(grad)
    return start, time.time()


def ps_calls(quick: bool) -> int:
    """Timed calls per trainer."""
    return 50 if quick else 200


def ps_rate(spans: list[tuple[float, float]], calls: int) -> float:
    """Calls per second of all trainers together, from each trainer's ``time.time()`` span
    (start, end) of ``calls`` timed calls: from the first start to the last end."""
    if not spans:
        raise ValueError("spans: no trainer reported a span")
    return len(spans) * calls / (max(end for _, end in spans) - min(start for start, _ in spans))


def emit(figures: dict[str, float]) -> None:
    """Hand ``figures`` to the runner: one line on standard output."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(figures) + "\n")
    sys.stdout.flush()
