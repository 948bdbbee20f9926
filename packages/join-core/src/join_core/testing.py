"""Run a function on several local ranks with a real gloo process group.

For tests and examples of code built on :mod:`join_core`::

    def train(rank: int, world_size: int) -> float:
        ...  # torch.distributed is initialised here
        return loss

    losses = run_ranks(train, world_size=3)

Every rank is a fresh process; the rendezvous store listens on 127.0.0.1 on a
port the OS picks. The call returns each rank's result in rank order, or
raises :class:`RanksFailedError` with every failing rank's traceback. It never
waits longer than ``timeout``: ranks still running then are killed.

:func:`run_script` runs a whole script per rank instead, as
``torchrun --nproc-per-node N`` would, and tells how each interpreter ended
(its exit code included: what happens at interpreter exit is seen too).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.context import BaseContext
from typing import Any, Final, Generic, TypeVar

import torch
import torch.distributed as dist

# torch's stubs do not re-export the store class it documents publicly.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]

__all__ = ["RanksFailedError", "ScriptExit", "run_ranks", "run_script"]

T = TypeVar("T")

#: After one rank fails, how long the others get to finish before being killed.
FAILURE_GRACE_S: Final = 30.0


class RanksFailedError(RuntimeError):
    """One or more ranks raised, or did not finish in time.

    Attributes:
        failures: rank -> the traceback (or reason) of each rank that failed.
    """

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        parts = [f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items())]
        super().__init__("ranks failed: " + ", ".join(map(str, sorted(failures))) + "\n" + "\n".join(parts))


@dataclass(frozen=True)
class _Outcome(Generic[T]):
    rank: int
    ok: bool
    value: T | None
    error: str


def _context(fn: Callable[..., Any]) -> BaseContext:
    # A fork server with torch already imported starts ranks in a fraction of
    # spawn's time; fork itself is unsafe once torch has started threads.
    ctx = multiprocessing.get_context("forkserver")
    # torch imports its compiler (torch._dynamo, about a second of CPU) when a
    # process makes its first optimizer: once in the server, not in every rank.
    preload = ["torch", "torch.distributed", "torch._dynamo"]
    module = getattr(fn, "__module__", None)
    # The server, started at the first call, can also import fn's module (and
    # so what that imports) once for every rank, unless torch has CUDA: a
    # module that asks torch.cuda anything at import would leave every rank
    # forked from the server unable to use CUDA.
    if module not in (None, "__main__", "__mp_main__") and not torch.backends.cuda.is_built():
        preload.append(module)
    ctx.set_forkserver_preload(preload)
    return ctx


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    results: multiprocessing.Queue[bytes],
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        store = TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        outcome: _Outcome[Any] = _Outcome(rank, True, value, "")
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        outcome = _Outcome(rank, False, None, traceback.format_exc())
    # Plain pickle: tensors travel by value, not as shared memory that dies
    # with this process.
    results.put(pickle.dumps(outcome))


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    ``fn`` must be importable by name (a module-level function) and its
    arguments and result picklable. Each process has the default process
    group initialised with ``backend`` before ``fn`` runs, and destroyed after.

    Args:
        fn: the function each rank runs.
        world_size: the number of ranks, at least 1.
        args: passed to ``fn`` after ``rank`` and ``world_size``.
        backend: the torch.distributed backend of the process group.
        timeout: seconds before ranks still running are killed.

    Raises:
        RanksFailedError: a rank raised or did not finish within ``timeout``.
    """
    if world_size < 1:
        raise ValueError(f"run_ranks(world_size={world_size}): need at least one rank")
    ctx = _context(fn)
    store = TCPStore(
        "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    results: multiprocessing.Queue[bytes] = ctx.Queue()
    procs = [
        ctx.Process(  # type: ignore[attr-defined]
            target=_rank_main,
            args=(fn, args, rank, world_size, store.port, backend, timeout, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, _Outcome[T]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                outcome: _Outcome[T] = pickle.loads(results.get(timeout=min(left, 1.0)))
            except queue.Empty:
                if all(not proc.is_alive() for proc in procs) and results.empty():
                    break  # a rank died without reporting
                continue
            outcomes[outcome.rank] = outcome
            if not outcome.ok:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    finally:
        killed = set()
        for rank, proc in enumerate(procs):
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if proc.is_alive():
                killed.add(rank)
                proc.kill()
                proc.join(timeout=5.0)
        results.close()
        del store
    failures = {rank: o.error for rank, o in outcomes.items() if not o.ok}
    for rank, proc in enumerate(procs):
        if rank in outcomes:
            continue
        if rank not in killed:
            failures[rank] = f"exited with code {proc.exitcode} before reporting a result"
        elif any(not o.ok for o in outcomes.values()):
            failures[rank] = "killed without a result (another rank had failed)"
        else:
            failures[rank] = f"no result within {timeout:.0f} s: killed"
    if failures:
        raise RanksFailedError(failures)
    return [outcomes[rank].value for rank in range(world_size)]  # type: ignore[misc]


@dataclass(frozen=True)
class ScriptExit:
    """How one rank's interpreter ended under :func:`run_script`."""

    rank: int
    returncode: int  # negative: killed by that signal
    output: str  # stdout and stderr, interleaved


def run_script(
    script: str | os.PathLike[str], world_size: int, *args: str, timeout: float = 120.0
) -> list[ScriptExit]:
    """Run ``python script *args`` as ``world_size`` fresh interpreters with
    torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...),
    so ``dist.init_process_group("gloo")`` needs no argument; the store is
    hosted here on a port the OS picks. Returns how each ended, in rank order.
    Interpreters still running after ``timeout`` seconds are killed (exit code
    ``-9``).
    """
    if world_size < 1:
        raise ValueError(f"run_script(world_size={world_size}): need at least one rank")
    store = TCPStore(
        "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    env = dict(
        os.environ,
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        # Files, not pipes: a rank that writes much never blocks on a reader.
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world_size)]
        procs = [
            subprocess.Popen(
                [sys.executable, os.fspath(script), *args],
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank, log in enumerate(logs)
        ]
        notes = [""] * world_size
        try:
            for rank, proc in enumerate(procs):
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    notes[rank] = f"\n[killed: still running after {timeout:.0f} s]"
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            del store
        exits = []
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            exits.append(ScriptExit(rank, proc.returncode, log.read() + notes[rank]))
    return exits
