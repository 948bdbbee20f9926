"""Run every peer's workloads in fresh processes, round after round, in alternating order.

Each round runs every peer once in an order rotated by one from the round
before, so that no peer always follows the same one. A peer runs twice a
round: the two-process workloads, then the parameter server, each in
processes started for it and given a time limit. A run that fails or times
out is recorded with its reason and the others go on: the table shows the
medians of the runs that completed and says what failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from peers.environments import Unavailable, prepare
from peers.workloads import PS_TRAINERS, RESULT_PREFIX

__all__ = ["PEERS", "Outcome", "PeerSpec", "run_once", "run_peers"]

_RUN_TIMEOUT_S: Final = 300.0
_BENCH: Final = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PeerSpec:
    """One peer: the environment it runs in and the module that runs its workloads."""

    key: str
    title: str
    env: str  # a tools/dev.py environment
    module: str
    dist: str  # the distribution whose version the table shows
    imports: str  # what must import in the environment
    stack: str | None = None  # for peers.rpc_api: the runner starts every rank


PEERS: Final = (
    PeerSpec("ours", "ours", "run", "peers.rpc_api", "rpc-registry", "tensorpipe_backend", stack="ours"),
    PeerSpec("torch", "torch RPC", "run", "peers.rpc_api", "torch", "torch.distributed.rpc", stack="torch"),
    PeerSpec("ray", "Ray actors", "peer-ray", "peers.ray_actors", "ray", "ray"),
    PeerSpec(
        "monarch",
        "Monarch actors",
        "peer-monarch",
        "peers.monarch_actors",
        "torchmonarch",
        "monarch.actor",
    ),
)


@dataclass
class Outcome:
    """What one peer gave over the rounds: its figures per round, and why runs failed."""

    spec: PeerSpec
    version: str = ""
    unavailable: str = ""  # set: the peer could not run here at all
    samples: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def median(self, key: str) -> float | None:
        """The median of ``key`` over the completed runs; None if none completed."""
        values = self.samples.get(key)
        return statistics.median(values) if values else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _commands(
    spec: PeerSpec, python: Path, workload: str, quick: bool, launched_at: float
) -> list[list[str]]:
    common = ["--workload", workload, "--launched-at", repr(launched_at), *(["--quick"] if quick else [])]
    if spec.stack is None:
        return [[str(python), "-m", spec.module, *common]]
    world_size = 2 if workload == "pair" else PS_TRAINERS + 1
    port = str(_free_port())
    ranks = ["--stack", spec.stack, "--world-size", str(world_size), "--port", port]
    return [
        [str(python), "-m", spec.module, *ranks, "--rank", str(rank), *common] for rank in range(world_size)
    ]


def _last_line(log: IO[str]) -> str:
    log.seek(0)
    lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:300]


def run_once(spec: PeerSpec, python: Path, workload: str, quick: bool) -> dict[str, float] | str:
    """One run of ``workload`` (``pair`` or ``ps``) for ``spec`` in fresh processes: the figures
    its first process printed, or why there are none."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_BENCH), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    launched_at = time.time()
    commands = _commands(spec, python, workload, quick, launched_at)
    procs: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as files:
        logs: list[IO[str]] = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        try:
            return _wait(workload, commands, logs, procs, env)
        finally:
            for proc in procs:
                # Whatever is left of the group: a process that timed out, or daemons (Ray's)
                # that outlived their driver.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _wait(
    workload: str,
    commands: list[list[str]],
    logs: list[IO[str]],
    procs: list[subprocess.Popen[bytes]],
    env: dict[str, str],
) -> dict[str, float] | str:
    """Start ``commands`` (appending to ``procs``), wait for them; the first one's figures."""
    for command, log in zip(commands, logs):
        # A session of its own: on a timeout the whole group goes, daemons included.
        procs.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        )
    deadline = time.monotonic() + _RUN_TIMEOUT_S
    while any(proc.poll() is None for proc in procs):
        # The first process to fail ends the run: the others would wait for it until the limit.
        for proc, log in zip(procs, logs):
            if proc.returncode not in (None, 0):
                return f"{workload}: exit {proc.returncode}: {_last_line(log)}"
        if time.monotonic() > deadline:
            return f"{workload}: timed out after {_RUN_TIMEOUT_S:.0f} s ({_last_line(logs[0])})"
        time.sleep(0.2)
    for proc, log in zip(procs, logs):
        if proc.returncode != 0:
            return f"{workload}: exit {proc.returncode}: {_last_line(log)}"
    logs[0].seek(0)
    for line in logs[0].read().splitlines():
        if line.startswith(RESULT_PREFIX):
            figures: dict[str, float] = json.loads(line[len(RESULT_PREFIX) :])
            return figures
    return f"{workload}: no figures printed ({_last_line(logs[0])})"


def run_peers(keys: list[str], rounds: int, quick: bool, say: Callable[[str], None] = print) -> list[Outcome]:
    """Every peer of ``keys`` (of :data:`PEERS`) over ``rounds`` rounds, in rotating order."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1 round")
    unknown = [key for key in keys if key not in {spec.key for spec in PEERS}]
    if unknown:
        raise ValueError(f"peers {unknown}: unknown; choose from {','.join(spec.key for spec in PEERS)}")
    outcomes = [Outcome(spec) for spec in PEERS if spec.key in keys]
    pythons: dict[str, Path] = {}
    for outcome in outcomes:
        say(f"[peers] {outcome.spec.key}: environment .venvs/{outcome.spec.env}")
        prepared = prepare(outcome.spec.env, outcome.spec.imports, outcome.spec.dist)
        if isinstance(prepared, Unavailable):
            outcome.unavailable = prepared.reason
            say(f"[peers] {outcome.spec.key}: cannot run here: {prepared.reason}")
        else:
            pythons[outcome.spec.key] = prepared.python
            outcome.version = prepared.version
    runnable = [o for o in outcomes if o.spec.key in pythons]
    for round_ in range(rounds):
        shift = round_ % len(runnable) if runnable else 0
        for outcome in runnable[shift:] + runnable[:shift]:
            for workload in ("pair", "ps"):
                start = time.monotonic()
                result = run_once(outcome.spec, pythons[outcome.spec.key], workload, quick)
                took = time.monotonic() - start
                if isinstance(result, str):
                    outcome.failures.append(f"round {round_ + 1}, {result}")
                    say(f"[peers] round {round_ + 1} {outcome.spec.key} {workload}: FAILED {result}")
                    continue
                for key, value in result.items():
                    outcome.samples.setdefault(key, []).append(value)
                shown = ", ".join(f"{key} {value:.4g}" for key, value in result.items())
                say(f"[peers] round {round_ + 1} {outcome.spec.key} {workload} ({took:.0f} s): {shown}")
    return outcomes
