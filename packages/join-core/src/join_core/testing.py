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

:func:`run_launch` runs a script under ``python -m join_core.launch`` (the
survivor agent) on 127.0.0.1, and :func:`start_launch` starts one such agent
of a job on several "hosts"; neither leaves a process behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Generic, TypeVar

import torch
import torch.distributed as dist

# torch's stubs do not re-export the store class it documents publicly.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]

__all__ = [
    "LaunchExit",
    "LaunchedAgent",
    "RanksFailedError",
    "ScriptExit",
    "launch_argv",
    "run_launch",
    "run_ranks",
    "run_script",
    "start_launch",
]

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
    _start_fork_server(_import_root(module) if module in preload else None)
    return ctx


def _import_root(module: str) -> str | None:
    """The folder ``module`` was imported from, as a ``sys.path`` entry (a test's, under pytest)."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if file is None:
        return None
    path = Path(os.path.abspath(file))  # not resolved: a symlinked package is found by its link
    return str(path.parents[module.count(".") + (path.name == "__init__.py")])


def _start_fork_server(root: str | None) -> None:
    """Start the fork server unless running, finding its preloads in ``root`` too.

    Python 3.11's fork server ignores the ``sys.path`` it is given, and skips
    a preload it cannot import: a module found through ``sys.path`` alone
    (pytest's test modules) was imported again by every rank, with what it
    imports (Lightning: over a second of CPU each). ``PYTHONPATH`` reaches it.
    """
    saved = os.environ.get("PYTHONPATH")
    if root is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, saved]))
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


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
        # fn runs once every rank is past its init: a rank done at once (and gone) reset the
        # connections of one still in gloo's init, which failed instead of running fn.
        store.set(f"run_ranks/initialized/{rank}", "")
        store.wait([f"run_ranks/initialized/{other}" for other in range(world_size)])
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


#: Seconds an agent gets to stop its workers after SIGTERM before it is killed.
AGENT_STOP_GRACE_S: Final = 15.0


@dataclass(frozen=True)
class LaunchExit:
    """How one agent of :func:`start_launch` or :func:`run_launch` ended."""

    returncode: int  # negative: killed by that signal
    output: str  # the agent's and its workers' stdout and stderr, interleaved
    worker_pids: tuple[int, ...]  # every process seen under the agent
    leaked: tuple[int, ...]  # those still running once the agent ended (killed then)


class LaunchedAgent:
    """One ``python -m join_core.launch`` agent and its workers, started by
    :func:`start_launch`. Leaving the context (or :meth:`wait`) stops whatever
    still runs: the agent with SIGTERM (it stops its workers), then SIGKILL,
    then any process seen under it that outlived it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        # A file, not a pipe: a chatty job never blocks on a reader. Closed by wait().
        self._log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self._proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        self._seen: dict[int, str] = {}  # pid -> its start time, to tell a reused pid apart
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="launch-watch", daemon=True)
        self._watcher.start()
        self._exit: LaunchExit | None = None

    @property
    def pid(self) -> int:
        """The agent's process id."""
        return self._proc.pid

    def _watch(self) -> None:
        while not self._stop.is_set() and self._proc.poll() is None:
            for pid in _descendants(self._proc.pid):
                if pid not in self._seen:
                    start = _start_time(pid)
                    if start is not None:
                        self._seen[pid] = start
            self._stop.wait(0.05)

    def wait(self, timeout: float) -> LaunchExit:
        """Wait up to ``timeout`` seconds for the agent to end (then stop it), and tell how it ended."""
        if self._exit is not None:
            return self._exit
        note = ""
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            note = f"\n[stopped: the agent still ran after {timeout:.0f} s]"
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=AGENT_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stop.set()
        self._watcher.join(timeout=5.0)
        leaked = []
        for pid, start in sorted(self._seen.items()):
            if _start_time(pid) == start:
                leaked.append(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._log.seek(0)
        output = self._log.read() + note
        self._log.close()
        self._exit = LaunchExit(self._proc.returncode, output, tuple(sorted(self._seen)), tuple(leaked))
        return self._exit

    def __enter__(self) -> LaunchedAgent:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.wait(timeout=0.0)


def launch_argv(
    script: str | os.PathLike[str], nproc: int, *args: str, launch_args: Sequence[str] = ()
) -> list[str]:
    """The command line of one agent on 127.0.0.1: ``python -m join_core.launch
    --nproc-per-node N --local-addr 127.0.0.1 [launch_args] script *args``; without an
    ``--rdzv-endpoint`` in ``launch_args``, a c10d rendezvous on a port the OS picks."""
    rendezvous = [] if any(a.startswith("--rdzv") for a in launch_args) else [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"
    ]  # fmt: skip
    return [
        sys.executable, "-m", "join_core.launch", "--nproc-per-node", str(nproc), "--local-addr", "127.0.0.1",
        *rendezvous, *launch_args, os.fspath(script), *args,
    ]  # fmt: skip


def start_launch(
    script: str | os.PathLike[str],
    nproc: int,
    *args: str,
    launch_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> LaunchedAgent:
    """Start ``python -m join_core.launch`` running ``script`` on ``nproc`` workers
    (see :func:`launch_argv`); wait for it with :meth:`LaunchedAgent.wait`.

    Example, two agents of one job, as on two hosts::

        store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        nodes = ["--nnodes", "2", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=0"]
        with start_launch("train.py", 2, launch_args=nodes) as a, start_launch("train.py", 2, launch_args=nodes) as b:
            exits = [a.wait(60), b.wait(60)]
    """
    merged = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(env or {}))
    return LaunchedAgent(launch_argv(script, nproc, *args, launch_args=launch_args), merged)


def run_launch(
    script: str | os.PathLike[str],
    nproc: int,
    *args: str,
    launch_args: Sequence[str] = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> LaunchExit:
    """Run ``script`` on ``nproc`` workers under ``python -m join_core.launch`` on
    this host and wait (at most ``timeout`` seconds, then stop everything)."""
    with start_launch(script, nproc, *args, launch_args=launch_args, env=env) as agent:
        return agent.wait(timeout)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux: /proc; elsewhere none)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (in clock ticks since boot), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None
