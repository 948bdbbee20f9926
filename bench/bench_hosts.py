"""Two "hosts": two network namespaces joined by a veth pair (root only): a 64 MiB echo and a DDP step.

    PYTHONPATH=packages/join-core/src:packages/rpc-registry/src:packages/tensorpipe-backend/src:bench \
        python bench/bench_hosts.py [--rounds N] [--quick]

Makes the namespaces ``tpb-bench-a-<pid>`` and ``tpb-bench-b-<pid>`` with
``ip netns``, a veth pair between them (10.213.<n>.1 and .2, nothing else
routed) and runs one worker in each, ours and torch's alternating per round;
then one DDP rank in each (gloo over the veth pair), timing our DDP step and
torch's on the MLP of the DDP figures in the same two processes.
The namespaces are deleted afterwards, also after an error, Ctrl-C or
SIGTERM. Traffic is TCP only: abstract Unix sockets do not cross network
namespaces and our agent shares memory only with a peer of the same
address; torch's agent is limited to its ``uv`` (TCP) transport and its
TCP channels (``mpt_uv``, ``basic``), since its ``cma`` and ``shm`` would
see one host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from benchlib import Figure

__all__ = ["two_host_figures", "two_hosts"]

_ECHO_MIB: Final = 64
_ROOT: Final = Path(__file__).resolve().parent.parent


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def two_hosts() -> Iterator[tuple[tuple[str, str, str], tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair; yields (namespace, interface, address) for each end."""
    tag = os.getpid()
    subnet = f"10.213.{tag % 250}"
    a = (f"tpb-bench-a-{tag}", f"tpbA{tag % 100000}", f"{subnet}.1")
    b = (f"tpb-bench-b-{tag}", f"tpbB{tag % 100000}", f"{subnet}.2")
    previous = signal.getsignal(signal.SIGTERM)

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    made: list[str] = []
    try:
        for namespace, _, _ in (a, b):
            _ip("netns", "add", namespace)
            made.append(namespace)
        _ip("link", "add", a[1], "netns", a[0], "type", "veth", "peer", "name", b[1], "netns", b[0])
        for namespace, interface, address in (a, b):
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield a, b
    finally:
        for namespace in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "delete", namespace], check=False, capture_output=True)
        signal.signal(signal.SIGTERM, previous)


def _worker(rank: int, kind: str, host: str, port: int, interface: str, echoes: int) -> dict[str, float]:
    """One worker of one pair; rank 0 echoes a 64 MiB tensor off rank 1 and returns GB/s."""
    import torch
    from bench_rpc import echo

    init_method = f"tcp://{host}:{port}"
    api: Any
    if kind == "torch":
        import torch.distributed.rpc as api

        # torch's agent and the gloo group it makes listen on this interface's address.
        os.environ["TP_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = interface
        options: Any = api.TensorPipeRpcBackendOptions(
            init_method=init_method, _transports=["uv"], _channels=["mpt_uv", "basic"]
        )
    else:
        import rpc_registry as api
        from tensorpipe_backend import TensorPipeRpcBackendOptions

        options = TensorPipeRpcBackendOptions(init_method=init_method)
    api.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, float] = {}
    if rank == 0:
        x = torch.randn(_ECHO_MIB * 1024 * 1024 // 4)
        if not torch.equal(api.rpc_sync("w1", echo, args=(x,)), x):
            raise AssertionError(f"{kind}: the echoed tensor differs from the one sent")
        if kind == "ours":
            from tensorpipe_backend.agent import get_current_agent

            transports = set(get_current_agent().peer_transports.values())
            if transports != {"tcp"}:
                raise AssertionError(f"ours: expected TCP between the namespaces, got {transports}")
        start = time.perf_counter()
        for _ in range(echoes):
            api.rpc_sync("w1", echo, args=(x,))
        out["echo_gb_s"] = 2 * _ECHO_MIB * echoes / (time.perf_counter() - start) / 1024
    api.shutdown()
    return out


def _ddp_worker(rank: int, host: str, port: int, interface: str, steps: int, rounds: int) -> dict[str, float]:
    """One DDP rank in its namespace: ms per step of ours and torch's, medians of ``rounds``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ddp_join import DistributedDataParallel

    os.environ["GLOO_SOCKET_IFNAME"] = interface
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=2)

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))

    models: dict[str, Any] = {"ours": DistributedDataParallel(mlp()), "torch": TorchDDP(mlp())}
    optimizers = {kind: torch.optim.SGD(model.parameters(), lr=0.01) for kind, model in models.items()}
    data = torch.randn(32, 256)

    def seconds_per_step(kind: str, count: int) -> float:
        model, optimizer = models[kind], optimizers[kind]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()
        dist.barrier()
        return (time.perf_counter() - start) / count

    for kind in models:
        seconds_per_step(kind, 5)  # warm-up
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for round_ in range(rounds):
        for kind in ("ours", "torch") if round_ % 2 == 0 else ("torch", "ours"):
            times[kind].append(seconds_per_step(kind, steps))
    dist.destroy_process_group()
    return {kind: statistics.median(values) * 1e3 for kind, values in times.items()}


def _free_port(namespace: str) -> int:
    # Any port works: nothing else listens in a fresh namespace.
    del namespace
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _pair(kind: str, a: tuple[str, str, str], b: tuple[str, str, str], echoes: int) -> float:
    result = _run_pair(
        "--worker", a, b, lambda rank, interface, port: [rank, kind, a[2], port, interface, echoes]
    )
    return result["echo_gb_s"]


def _run_pair(
    mode: str, a: tuple[str, str, str], b: tuple[str, str, str], arguments: Any
) -> dict[str, float]:
    """Run this script with ``mode`` in each namespace (rank 0 in ``a``); rank 0's result."""
    port = _free_port(a[0])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = []
    for rank, (namespace, interface, _) in enumerate((a, b)):
        command = [
            "ip", "netns", "exec", namespace, sys.executable, str(Path(__file__)), mode,
            json.dumps(arguments(rank, interface, port)),
        ]  # fmt: skip
        procs.append(subprocess.Popen(command, env=env, cwd=_ROOT, stdout=subprocess.PIPE, text=True))
    try:
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode != 0 for proc in procs):
        raise RuntimeError(
            f"{mode} {arguments(0, a[1], port)}: a worker failed (exit codes {[p.returncode for p in procs]})"
        )
    result: dict[str, float] = json.loads(outputs[0].strip().splitlines()[-1])
    return result


def two_host_figures(rounds: int, quick: bool) -> list[Figure]:
    """The 64 MiB echo over TCP between two namespaces, ours vs torch's, medians of ``rounds``."""
    if os.geteuid() != 0:
        raise PermissionError("--two-hosts makes network namespaces: run it as root")
    samples: dict[str, list[float]] = {"ours": [], "torch": []}
    with two_hosts() as (a, b):
        for round_ in range(rounds):
            for kind in ("ours", "torch") if round_ % 2 == 0 else ("torch", "ours"):
                samples[kind].append(_pair(kind, a, b, 3 if quick else 10))
        steps = (10, 3) if quick else (30, 2 * rounds)
        ddp = _run_pair(
            "--ddp-worker", a, b, lambda rank, interface, port: [rank, a[2], port, interface, *steps]
        )
    ours, theirs = statistics.median(samples["ours"]), statistics.median(samples["torch"])
    return [
        Figure(
            f"{_ECHO_MIB} MiB echo between two hosts (netns + veth, TCP only)",
            "GB/s",
            ours,
            theirs,
            ">= 1.5x",
            ours / theirs,
            ours >= 1.5 * theirs,
        ),
        Figure(
            "DDP step, MLP, batch 32, one rank on each of two hosts (netns + veth, gloo)",
            "ms/step",
            ddp["ours"],
            ddp["torch"],
            ">= 1.0x",
            ddp["torch"] / ddp["ours"],
            ddp["ours"] <= ddp["torch"],
        ),
    ]


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="fewer echoes per round")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ddp-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(*json.loads(args.worker))))
        return 0
    if args.ddp_worker:
        print(json.dumps(_ddp_worker(*json.loads(args.ddp_worker))))
        return 0
    for f in two_host_figures(args.rounds, args.quick):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
