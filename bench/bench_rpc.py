"""RPC benchmarks: ``rpc_registry`` on the TENSORPIPE backend against torch's own RPC agent.

    PYTHONPATH=packages/join-core/src:packages/rpc-registry/src:packages/tensorpipe-backend/src:bench \
        python bench/bench_rpc.py [--rounds N] [--quick]

Every round starts two fresh processes (127.0.0.1, CPU) for each stack, ours
and torch's in alternating order, and measures in each what
``/work/shared/anchors/rpc_bench.py`` measures for torch: the ``init_rpc`` time
of rank 0, the mean ``rpc_sync`` no-op round trip after 200 warm-up calls,
the throughput of 2000 ``rpc_async`` no-ops issued then waited for, and the
bytes both ways per second of ``rpc_sync(echo, x)`` with a 64 MiB tensor.
Against a raw 1-byte round trip over a TCP socket between the same two
processes, timed call by call in turns with ours: the p50 and p99 of each.
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
import threading
import time
from typing import Any, Final

import torch
import torch.distributed as dist
from benchlib import Figure

from join_core.testing import run_ranks

__all__ = ["echo", "flood", "noop", "ps_figures", "ps_update", "rpc_figures"]

_ECHO_MIB: Final = 64
_SYNC_CALLS: Final = 2000
_ASYNC_CALLS: Final = 2000
_WARMUP: Final = 200
_NUM_WORKER_THREADS: Final = 16
_FLOOD_CALLS: Final = 48
_FLOOD_BYTES: Final = 200_000


def noop() -> None:
    """The no-op the callee runs."""
    return None


def echo(x: torch.Tensor) -> torch.Tensor:
    """Return ``x``: the callee's side of the tensor echo."""
    return x


def flood(api_name: str, to: str) -> int:
    """Send ``to`` the crossing flood's echo calls, all at once; how many came back whole."""
    api: Any = importlib.import_module(api_name)
    blob = os.urandom(_FLOOD_BYTES)
    futures = [api.rpc_async(to, echo, args=(blob,)) for _ in range(_FLOOD_CALLS)]
    return sum(future.wait() == blob for future in futures)


def _echo_bytes(sock: socket.socket) -> None:
    """Serve raw round trips on ``sock``: every byte read goes back at once, until the peer closes."""
    with sock:
        while data := sock.recv(64):
            sock.sendall(data)


def _raw_servers() -> tuple[int, bytes]:
    """A TCP listener on 127.0.0.1 and a Unix one, each serving one connection with
    :func:`_echo_bytes` on a thread; their port and abstract name."""
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(b"\0bench-raw-" + os.urandom(8).hex().encode())
    unix.listen(1)

    def serve(listener: socket.socket) -> None:
        with listener:
            sock, _ = listener.accept()
        if sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _echo_bytes(sock)

    for listener in (tcp, unix):
        threading.Thread(target=serve, args=(listener,), daemon=True).start()
    return tcp.getsockname()[1], unix.getsockname()


def _raw_round_trips_us(sock: socket.socket, calls: int) -> list[float]:
    """Microseconds of each of ``calls`` 1-byte round trips on ``sock`` (after warm-up)."""
    for _ in range(_WARMUP):
        sock.sendall(b"x")
        sock.recv(64)
    gc.collect()
    clock, times = time.perf_counter, []
    for _ in range(calls):
        start = clock()
        sock.sendall(b"x")
        sock.recv(64)
        times.append((clock() - start) * 1e6)
    return times


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _measure(rank: int, world_size: int, kind: str, port: int, quick: bool) -> dict[str, float]:
    """One stack's figures in one fresh process pair; rank 0 returns them."""
    # Raw socket round trips between the same two processes, before the agents start.
    addresses: list[Any] = [None, None]
    dist.all_gather_object(addresses, _raw_servers() if rank == 1 else None)
    tcp_port, unix_name = addresses[1]
    raw: dict[str, socket.socket] = {}
    if rank == 0:
        raw["tcp"] = socket.create_connection(("127.0.0.1", tcp_port))
        raw["tcp"].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw["unix"] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw["unix"].connect(unix_name)
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
        # The raw round trips and the rpc_sync ones in turn, so that a burst of load hits both alike.
        # Means per turn (as timeit), and every call's time for the percentiles.
        samples: dict[str, list[float]] = {"sync_us": [], "raw_tcp_us": [], "raw_unix_us": []}
        calls: dict[str, list[float]] = {"sync": [], "raw_tcp": []}
        clock = time.perf_counter
        for _ in range(3):
            for transport, sock in raw.items():
                times = _raw_round_trips_us(sock, sync_calls // 3)
                samples[f"raw_{transport}_us"].append(statistics.fmean(times))
                calls.setdefault(f"raw_{transport}", []).extend(times)
            gc.collect()
            times = []
            for _ in range(sync_calls // 3):
                start = clock()
                api.rpc_sync("w1", noop)
                times.append((clock() - start) * 1e6)
            samples["sync_us"].append(statistics.fmean(times))
            calls["sync"].extend(times)
        for sock in raw.values():
            sock.close()
        out.update({key: statistics.median(values) for key, values in samples.items()})
        for key in ("sync", "raw_tcp"):
            out[f"{key}_p50_us"] = _quantile(calls[key], 0.50)
            out[f"{key}_p99_us"] = _quantile(calls[key], 0.99)
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
        # Both workers answer large replies while their own calls go out: neither may stop reading.
        floods = []
        for _ in range(3 if quick else 5):
            start = time.perf_counter()
            crossing = api.rpc_async("w1", flood, args=(api.__name__, "w0"))
            if flood(api.__name__, "w1") + crossing.wait() != 2 * _FLOOD_CALLS:
                raise AssertionError(f"{kind}: a crossing echo came back different")
            floods.append(time.perf_counter() - start)
        out["flood_ms"] = statistics.median(floods) * 1e3
    api.shutdown()
    return out


def rpc_figures(rounds: int, quick: bool) -> list[Figure]:
    """The RPC figures, medians over ``rounds`` rounds of ours and torch's, alternating."""
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
    # Percentiles of single calls against the raw TCP round trip's in the same processes.
    for q, bound in (("p50", 1.5), ("p99", 2.0)):
        raw = statistics.median(samples["ours"][f"raw_tcp_{q}_us"] + samples["torch"][f"raw_tcp_{q}_us"])
        ours = median("ours", f"sync_{q}_us")
        figures.append(
            Figure(
                f"rpc_sync no-op round trip {q} vs raw Python TCP round trip {q}",
                "us",
                ours,
                raw,
                f"<= {bound:g}x",
                ours / raw,
                ours <= bound * raw,
                reference="raw TCP",
            )
        )
    raw = statistics.median(samples["ours"]["raw_unix_us"] + samples["torch"]["raw_unix_us"])
    ours = median("ours", "sync_us")
    figures.append(
        Figure(
            "rpc_sync no-op round trip vs raw Python Unix socket round trip (means)",
            "us",
            ours,
            raw,
            "(floor)",
            ours / raw,
            True,
            reference="raw Unix socket",
        )
    )
    for name, unit, key, lower_is_better in (
        ("rpc_sync no-op round trip", "us", "sync_us", True),
        ("rpc_async no-op throughput", "calls/s", "async_per_s", False),
        (f"{_ECHO_MIB} MiB tensor echo", "GB/s", "echo_gb_s", False),
        (
            f"two workers sending each other {_FLOOD_CALLS} echo calls of {_FLOOD_BYTES // 1000} KB at once",
            "ms",
            "flood_ms",
            True,
        ),
        ("init_rpc, 2 workers", "s", "init", True),
    ):
        ours, theirs = median("ours", key), median("torch", key)
        if key == "sync_us":  # the only figure whose goal is ours / torch's
            ratio = ours / theirs
            goal, met = "<= 0.2x", ours <= 0.2 * theirs
        elif key == "flood_ms":  # a guard: a reader that waits to send stalls both workers
            ratio = ours / theirs
            goal, met = "<= 1.0x", ours <= theirs
        elif lower_is_better:
            ratio = ours / theirs
            goal, met = "<= 0.5x", ours <= 0.5 * theirs
        else:
            ratio = ours / theirs
            goal, met = ">= 2x", ours >= 2 * theirs
        figures.append(Figure(name, unit, ours, theirs, goal, ratio, met))
    return figures


_PS_TRAINERS: Final = 8
_PS_MIB: Final = 1
_ps_lock = threading.Lock()
_ps_param: list[torch.Tensor] = []


def ps_update(grad: torch.Tensor) -> torch.Tensor:
    """The server's side of a parameter-server step: apply ``grad``, return the new parameters."""
    with _ps_lock:
        if not _ps_param:
            _ps_param.append(torch.zeros_like(grad))
        _ps_param[0].add_(grad, alpha=-0.01)
        return _ps_param[0].clone()


def _parameter_server(
    rank: int, world_size: int, kind: str, port: int, calls: int, own_session: bool = False
) -> float:
    """Rank 0 serves, the others each make ``calls`` ``rpc_sync(ps_update, 1 MiB)``; rank 0
    returns the calls per second of all trainers together. With ``own_session`` each rank
    starts a session of its own first, as torchrun starts its workers (where the kernel's
    autogroup scheduling is on, each session is then scheduled as a group of its own)."""
    if own_session:
        os.setsid()
    init_method = f"tcp://127.0.0.1:{port}"
    api: Any
    if kind == "torch":
        import torch.distributed.rpc as api

        options: Any = api.TensorPipeRpcBackendOptions(
            num_worker_threads=_NUM_WORKER_THREADS, init_method=init_method
        )
    else:
        import rpc_registry as api
        from tensorpipe_backend import TensorPipeRpcBackendOptions

        options = TensorPipeRpcBackendOptions(num_worker_threads=_NUM_WORKER_THREADS, init_method=init_method)
    api.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    grad = torch.randn(int(_PS_MIB * 1024 * 1024) // 4)
    if rank > 0:
        for _ in range(10):
            api.rpc_sync("w0", ps_update, args=(grad,))
    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    if rank > 0:
        for _ in range(calls):
            api.rpc_sync("w0", ps_update, args=(grad,))
    dist.barrier()
    elapsed = time.perf_counter() - start
    api.shutdown()
    return (world_size - 1) * calls / elapsed


def ps_figures(rounds: int, quick: bool) -> list[Figure]:
    """Parameter server: 8 trainers rpc_sync 1 MiB tensors to one server; calls/s, ours vs torch,
    with the ranks in the session of the benchmark (as ``mp.spawn`` starts them) and each in a
    session of its own (as torchrun does). Also 1 trainer, the same calls with no other process
    contending for the cores (no goal)."""
    calls = 50 if quick else 200
    figures = []
    for trainers, own_session in ((_PS_TRAINERS, False), (_PS_TRAINERS, True), (1, False)):
        samples: dict[str, list[float]] = {"ours": [], "torch": []}
        for round_ in range(rounds):
            for kind in ("ours", "torch") if round_ % 2 == 0 else ("torch", "ours"):
                rate = run_ranks(
                    _parameter_server, trainers + 1, kind, _free_port(), calls, own_session, timeout=600
                )[0]
                samples[kind].append(rate)
        ours, theirs = statistics.median(samples["ours"]), statistics.median(samples["torch"])
        goal, met = (">= 2x", ours >= 2 * theirs) if trainers == _PS_TRAINERS else ("(context)", True)
        sessions = ", each rank a session of its own (as torchrun starts them)" if own_session else ""
        figures.append(
            Figure(
                f"parameter server: {trainers} trainer{'s' if trainers > 1 else ''}, rpc_sync {_PS_MIB} MiB to one server{sessions}",
                "calls/s",
                ours,
                theirs,
                goal,
                ours / theirs,
                met,
            )
        )
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
