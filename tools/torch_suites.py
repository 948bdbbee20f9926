"""Run torch's own RPC test suites against rpc-registry and tensorpipe-backend.

torch's wheel ships ``rpc_test.py``, ``dist_autograd_test.py`` and
``dist_optimizer_test.py`` under ``torch/testing/_internal/distributed/rpc``,
``ddp_under_dist_autograd_test.py`` (ddp-join's DistributedDataParallel
under distributed autograd) beside them and ``nn/api/remote_module_test.py``.
Their tests that use only public API are a fair contract for a replacement
of ``torch.distributed.rpc``; this script finds those (reading each test and
the helpers it calls), runs them with torch's RPC names pointed at ours
(``torch_suites_shim.py``) and prints ``N of M applicable tests passed``.

A test is not applicable when it reaches (directly or through helpers of the
suite) a private name of ``torch.distributed`` or ``torch._C`` (``rpc.api._*``,
debug info, ...), TorchScript, the profiler, or CUDA on a machine without a GPU.

Worker processes, as many as the test class's world size (four for most),
stay up for the whole run; every
test runs in all four with a fresh ``file://`` rendezvous, as torch's
``dist_init`` sets it up. A test that fails is run once more in fresh
processes, so state left by an earlier test cannot fail it.

Usage::

    python tools/torch_suites.py                  # all three suites
    python tools/torch_suites.py --suite dist_autograd_test -k backward
    python tools/torch_suites.py --list           # what is applicable, and why not
    python tools/torch_suites.py --suite dist_autograd_test -k test_trainer_ps --repeat 10
                                                  # each run in fresh processes, no retry

A test that runs past its timeout has every worker's Python stacks printed
(all threads) before the workers are stopped.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import faulthandler
import importlib
import inspect
import multiprocessing
import os
import signal
import sys
import tempfile
import textwrap
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_suites_shim

PACKAGE: Final = "torch.testing._internal.distributed.rpc"
SUITES: Final = {
    "rpc_test": ("RpcTest", "TensorPipeAgentRpcTest"),
    "dist_autograd_test": ("DistAutogradTest", "TensorPipeAgentDistAutogradTest"),
    "dist_optimizer_test": ("DistOptimizerTest",),
    "ddp_under_dist_autograd_test": ("DdpUnderDistAutogradTest", "DdpComparisonTest"),
    "remote_module_test": ("RemoteModuleTest", "ThreeWorkersRemoteModuleTest"),
}
# Suites that live outside PACKAGE, by their module.
MODULES: Final = {
    "ddp_under_dist_autograd_test": "torch.testing._internal.distributed.ddp_under_dist_autograd_test",
    "remote_module_test": "torch.testing._internal.distributed.nn.api.remote_module_test",
}
WORLD_SIZE: Final = 4
# How long the workers may take to import torch and the suites.
STARTUP_TIMEOUT_S: Final = 300.0
# Private methods of torch's RRef (the suites call them on RRef objects, not on a module).
_PRIVATE_RREF_METHODS: Final = frozenset({"_get_type", "_get_future", "_serialize", "_set_profiling_future"})
# The suites' harness, which sets up RPC around a test (with private names): not the test.
_HARNESS: Final = frozenset({"dist_init"})
# remote_module_test's helper builds a TorchScript RemoteModule only for the modes a test asks
# for; a test that asks for MODULE_CTOR alone never reaches that branch.
_MODULE_CTOR_ONLY: Final = "modes=[ModuleCreationMode.MODULE_CTOR]"
_SCRIPTED_MODE: Final = "MODULE_CTOR_WITH_INTERFACE"
# Tests that name .cuda() only to check that RemoteModule refuses it (no GPU is used).
_CUDA_ONLY_REFUSED: Final = frozenset({"test_unsupported_methods"})
# Not public API, though not named with an underscore.
_INTERNAL_MODULES: Final = ("torch.distributed.rpc.internal",)
_PRIVATE_HOMES: Final = (
    "torch.distributed",
    "torch._C",
    "torch.autograd.profiler",
    "torch.testing._internal.dist_utils",
)


@dataclass(frozen=True)
class Case:
    """One test: suite module, class and method; ``reason`` why it is not applicable, if so."""

    suite: str
    cls: str
    method: str
    reason: str | None
    world_size: int = WORLD_SIZE  # the class's world_size property

    @property
    def name(self) -> str:
        return f"{self.suite}.{self.cls}.{self.method}"


def suite_module(suite: str) -> str:
    """The module that holds ``suite``."""
    return MODULES.get(suite, f"{PACKAGE}.{suite}")


# Finding the applicable tests.
def _source_tree(fn: Callable[..., Any]) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None


_IMPORTS: dict[str, dict[str, str]] = {}


def _imported_from(module_name: str, name: str) -> str:
    """The module that ``module_name`` imports ``name`` from ("" when it does not)."""
    if module_name not in _IMPORTS:
        found: dict[str, str] = {}
        module = sys.modules.get(module_name)
        tree = None
        with contextlib.suppress(OSError, TypeError, SyntaxError):
            tree = ast.parse(inspect.getsource(module)) if module is not None else None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    found[alias.asname or alias.name] = node.module
        _IMPORTS[module_name] = found
    return _IMPORTS[module_name].get(name, "")


def _private_home(value: object) -> bool:
    home = getattr(value, "__module__", None) or getattr(value, "__name__", "")
    return isinstance(home, str) and home.startswith(_PRIVATE_HOMES)


def _reason(cls: type, fn: Callable[..., Any], seen: set[object]) -> str | None:
    """Why ``fn`` (a test or a helper it calls) is not applicable, or None."""
    fn = inspect.unwrap(fn)
    if fn in seen:
        return None
    seen.add(fn)
    tree = _source_tree(fn)
    if tree is None:
        return None
    source = ast.unparse(tree)
    ctor_only = _MODULE_CTOR_ONLY in source and _SCRIPTED_MODE not in source
    if "cuda" in source.lower() and not torch_cuda_available() and fn.__name__ not in _CUDA_ONLY_REFUSED:
        return "CUDA (no GPU here)"
    if "torch.jit" in source or "jit.script" in source:
        return "TorchScript"
    if "profiler" in source or "_profile" in source or "record_function" in source:
        return "profiler"
    names: dict[str, Any] = getattr(fn, "__globals__", {})
    # Modules imported inside the function, by the name they are bound to.
    local_modules = {
        alias.asname or alias.name: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            )
            for module in modules:
                if module.startswith(_INTERNAL_MODULES):
                    return f"internal module {module}"
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("patch", "patch.object")):
            # mock.patch.object(module, "_name") / mock.patch("module._name"): replaces a private name.
            for arg in node.args:
                value = arg.value if isinstance(arg, ast.Constant) else None
                if isinstance(value, str) and (value.startswith("_") or "._" in value):
                    return f"mocks private name {value}"
        if isinstance(node, ast.Attribute):
            base = node.value
            attr = node.attr
            if isinstance(base, ast.Name) and base.id == "self":
                helper = getattr(cls, attr, None)
                if ctor_only and attr == "_create_remote_module_iter":
                    continue
                if inspect.isfunction(helper) or inspect.ismethod(helper):
                    found = _reason(cls, helper, seen)
                    if found:
                        return found
                continue
            if attr in _PRIVATE_RREF_METHODS:
                return f"private name {ast.unparse(node)}"
            if attr.startswith("_") and not attr.startswith("__"):
                owner = names.get(base.id) if isinstance(base, ast.Name) else None
                if isinstance(base, ast.Name) and base.id in local_modules:
                    owner = importlib.import_module(local_modules[base.id])
                if owner is None and isinstance(base, ast.Attribute):
                    owner = base  # e.g. rpc.api._x: private wherever it lives
                if isinstance(owner, types.ModuleType) and owner.__name__.startswith(_PRIVATE_HOMES):
                    return f"private name {ast.unparse(node)}"
                if isinstance(owner, ast.Attribute) and ast.unparse(owner).startswith(("rpc.", "torch.")):
                    return f"private name {ast.unparse(node)}"
        elif isinstance(node, ast.Name) and node.id in names:
            value = names[node.id]
            if isinstance(value, (torch_jit_types())):
                return f"TorchScript ({node.id})"
            if node.id.startswith("_") and not node.id.startswith("__"):
                home = _imported_from(getattr(fn, "__module__", "") or "", node.id)
                if _private_home(value) or home.startswith(_PRIVATE_HOMES):
                    return f"private name {node.id}"
            if node.id in _HARNESS:
                continue
            if inspect.isfunction(value) and value.__module__.startswith("torch.testing._internal"):
                found = _reason(cls, value, seen)
                if found:
                    return found
    return None


def torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def torch_jit_types() -> tuple[type, ...]:
    import torch

    return (torch.jit.ScriptFunction, torch.jit.ScriptModule)


def _world_size(cls: type) -> int:
    """The world size a test class asks for (its ``world_size`` property returns a constant)."""
    prop = inspect.getattr_static(cls, "world_size", None)
    if isinstance(prop, property) and prop.fget is not None:
        with contextlib.suppress(Exception):
            size = prop.fget(None)
            if isinstance(size, int) and size > 0:
                return size
    return WORLD_SIZE


def collect(suites: list[str], patterns: list[str] | None) -> list[Case]:
    """The tests of ``suites`` (their names containing one of ``patterns``), each with its applicability."""
    torch_suites_shim.install()
    cases = []
    for suite in suites:
        module = importlib.import_module(suite_module(suite))
        for cls_name in SUITES[suite]:
            cls = getattr(module, cls_name)
            for method in sorted(name for name in dir(cls) if name.startswith("test_")):
                if patterns and not any(pattern in method for pattern in patterns):
                    continue
                fn = getattr(cls, method)
                cases.append(Case(suite, cls_name, method, _reason(cls, fn, set()), _world_size(cls)))
    return cases


# Running them.
def _test_class(suite: str, cls_name: str) -> type:
    from torch.testing._internal.common_distributed import MultiProcessTestCase
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    name = f"Shim{cls_name}"
    known = getattr(torch_suites_shim, name, None)
    if isinstance(known, type):
        return known
    base = getattr(importlib.import_module(suite_module(suite)), cls_name)
    cls = type(name, (base, TensorPipeRpcAgentTestFixture, MultiProcessTestCase), {})
    # Some tests send their bound methods by RPC: the class must be importable by name everywhere.
    cls.__module__ = torch_suites_shim.__name__
    setattr(torch_suites_shim, name, cls)
    return cls


def _run_here(rank: int, case: tuple[str, str, str], file_name: str) -> tuple[str, str]:
    """Run one test as ``rank``: ("pass" | "skip" | "fail", details)."""
    import unittest

    import torch.distributed

    import rpc_registry.api
    import rpc_registry.engine

    suite, cls_name, method = case
    try:
        cls = _test_class(suite, cls_name)
        test = cls(method)
        test.rank = rank
        test.file_name = file_name
        getattr(cls, method)(test)
        return "pass", ""
    except unittest.SkipTest as exc:
        return "skip", str(exc)
    except SystemExit as exc:
        return "skip", f"exited with {exc.code} (torch's skip codes)"
    except BaseException:  # noqa: BLE001 - reported to the runner
        return "fail", traceback.format_exc()
    finally:
        if rpc_registry.engine._state is not None:
            # The next test starts clean either way.
            with contextlib.suppress(Exception):
                rpc_registry.api.shutdown(graceful=False)
        if torch.distributed.is_initialized():
            # A process group a test left (torch runs each test in fresh processes).
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()


def _preload() -> None:
    """Import the shim and the suites once, before the workers fork (see ``Pool``)."""
    from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: F401
    from torch.testing._internal.distributed.rpc import tensorpipe_rpc_agent_test_fixture  # noqa: F401

    torch_suites_shim.install()
    for suite in SUITES:
        importlib.import_module(suite_module(suite))


#: The name the fork server imports this module by, to preload there (``Pool``): not
#: "__main__", which Python 3.11's fork server skips (it never finds the main module's path);
#: and it ignores the sys.path it is given, so ``Pool`` puts this folder on PYTHONPATH.
PRELOAD_NAME: Final = Path(__file__).stem

if __name__ == PRELOAD_NAME:
    _preload()


def _worker(rank: int, conn: Connection) -> None:
    os.environ.setdefault("TENSORPIPE_BACKEND_QUIET", "1")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks of a test that hangs
    torch_suites_shim.install()
    conn.send("ready")  # a test's time starts now, not while torch is imported
    while True:
        job = conn.recv()
        if job is None:
            return
        case, file_name = job
        conn.send(_run_here(rank, case, file_name))


class Pool:
    """``WORLD_SIZE`` processes that run each test together.

    They fork from a forkserver that imported torch and the suites once
    (``_preload``), so a fresh pool (after a failure) starts in a moment
    rather than the half minute that four imports of torch take.
    """

    def __init__(self, world_size: int = WORLD_SIZE) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([PRELOAD_NAME])
        here = str(Path(__file__).resolve().parent)
        if here not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        self.world_size = world_size
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._ready = False

    def wait_ready(self) -> None:
        """Wait until every worker imported what it needs (slow on a loaded machine)."""
        if self._ready:
            return
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(deadline - time.monotonic(), 0.0)) or conn.recv() != "ready":
                raise TimeoutError(f"worker of rank {rank} did not start within {STARTUP_TIMEOUT_S:g} s")
        self._ready = True

    def run(self, case: Case, timeout: float) -> tuple[str, str]:
        """The outcome of ``case`` over all ranks: a failure on any rank fails it."""
        with tempfile.NamedTemporaryFile(prefix="torch_suites_", delete=False) as handle:
            file_name = handle.name
        os.unlink(file_name)
        try:
            self.wait_ready()
            for conn in self.conns:
                conn.send(((case.suite, case.cls, case.method), file_name))
            deadline = time.monotonic() + timeout
            outcomes = []
            for rank, conn in enumerate(self.conns):
                if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                    self.dump_stacks()
                    raise TimeoutError(f"rank {rank} did not finish {case.name} within {timeout:g} s")
                outcomes.append(conn.recv())
        finally:
            # The rendezvous file and the ones tests derive from its name (file_name + "init_2", ...).
            for leftover in Path(file_name).parent.glob(Path(file_name).name + "*"):
                leftover.unlink(missing_ok=True)
        for status in ("fail", "skip"):
            # Every rank that failed: the first one's error may only follow from another's.
            found = [
                f"rank {rank}: {details}" for rank, (got, details) in enumerate(outcomes) if got == status
            ]
            if found:
                return status, "\n".join(found)
        return "pass", ""

    def dump_stacks(self) -> None:
        """Have every worker print the stacks of all its threads (to stderr)."""
        print("-- stacks of the workers, rank by rank:", file=sys.stderr, flush=True)
        for proc in self.procs:
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(0.5)  # one rank's stacks at a time

    def close(self, graceful: bool = True) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if graceful and proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
            proc.join(timeout=5 if graceful else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _run_case(pool: Pool, case: Case, timeout: float) -> tuple[Pool, str, str]:
    try:
        status, details = pool.run(case, timeout)
    except (TimeoutError, EOFError, OSError) as exc:
        pool.close(graceful=False)
        return Pool(case.world_size), "fail", f"{type(exc).__name__}: {exc}"
    return pool, status, details


def run(cases: list[Case], timeout: float, verbose: bool) -> Iterator[tuple[Case, str, str]]:
    """Run the applicable ``cases``; yields each with its status and details.

    The status is "pass", "skip", "fail", or "retry": failed, then passed in
    fresh processes (the details are the first failure's).
    """
    pool = Pool(cases[0].world_size if cases else WORLD_SIZE)
    try:
        for case in cases:
            started = time.monotonic()
            if pool.world_size != case.world_size:
                pool.close()
                pool = Pool(case.world_size)
            pool, status, details = _run_case(pool, case, timeout)
            if status == "fail":
                # Once more in fresh processes: the first failure may be an earlier test's leftovers.
                pool.close(graceful=False)
                first = details
                pool, status, details = _run_case(Pool(case.world_size), case, timeout)
                if status == "pass":
                    status, details = "retry", first
            if verbose:
                print(f"{status:5} {case.name} ({time.monotonic() - started:.1f} s)", flush=True)
            yield case, status, details
    finally:
        pool.close()


def repeat(cases: list[Case], times: int, timeout: float) -> int:
    """Run each case ``times`` times, each in fresh processes and without a retry (to
    measure a flaky test, e.g. with copies of this script running at once); 0 if all passed."""
    failed = 0
    for case in cases:
        statuses = []
        for run_index in range(times):
            started = time.monotonic()
            pool, status, details = _run_case(Pool(case.world_size), case, timeout)
            pool.close(graceful=status == "pass")
            last = details.strip().splitlines()[-1] if details.strip() else ""
            print(f"{status:5} {case.name} run {run_index + 1} ({time.monotonic() - started:.1f} s) {last}")
            statuses.append(status)
        passed = statuses.count("pass")
        failed += times - passed - statuses.count("skip")
        print(f"{case.name}: {passed} of {times} runs passed", flush=True)
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="append", choices=sorted(SUITES), help="default: all")
    parser.add_argument(
        "-k", dest="patterns", action="append", help="only tests whose name contains this (repeatable: any)"
    )
    parser.add_argument("--list", action="store_true", help="list the tests and why some are not applicable")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per test (default 60)")
    parser.add_argument(
        "--min-pass",
        type=float,
        default=0.95,
        help="fail when a suite passes less than this share (default 0.95)",
    )
    parser.add_argument("--report", type=Path, help="write every failure's traceback to this file")
    parser.add_argument(
        "--repeat", type=int, default=0, help="run each test this many times, in fresh processes, no retry"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    cases = collect(args.suite or sorted(SUITES), args.patterns)
    applicable = [case for case in cases if case.reason is None]
    if args.list:
        for case in cases:
            print(f"{case.name}: {case.reason or 'applicable'}")
        print(f"{len(applicable)} of {len(cases)} tests are applicable")
        return 0
    if args.repeat > 0:
        return repeat(applicable, args.repeat, args.timeout)
    start = time.monotonic()
    if args.report:
        args.report.write_text("")
    results = []
    for case, status, details in run(applicable, args.timeout, args.verbose):
        results.append((case, status, details))
        if args.report and status in ("fail", "retry"):
            with args.report.open("a") as report:  # as they happen: a long run can be read while it goes
                report.write(
                    f"== {case.name}{' (passed on retry)' if status == 'retry' else ''}\n{details}\n"
                )
    for case, status, details in results:
        if status in ("fail", "retry"):
            last = details.strip().splitlines()[-1] if details.strip() else "?"
            print(f"{'FAILED' if status == 'fail' else 'PASSED ON RETRY'} {case.name}: {last}")
    ok = True
    for suite in sorted({case.suite for case in cases}):
        statuses = [status for case, status, _ in results if case.suite == suite]
        counted = sum(1 for status in statuses if status != "skip")
        passed = sum(1 for status in statuses if status in ("pass", "retry"))
        ok = ok and counted > 0 and passed >= args.min_pass * counted
        print(
            f"{suite}: {passed} of {counted} applicable tests passed "
            f"({statuses.count('retry')} of them on a retry in fresh processes, "
            f"{statuses.count('skip')} skipped at run time, "
            f"{sum(1 for case in cases if case.suite == suite and case.reason)} not applicable)"
        )
    print(f"in {time.monotonic() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
