"""The RPC API: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``, ``shutdown`` and friends.

They work on top of any :class:`~rpc_registry.protocols.RpcAgent`:
``init_rpc`` creates the backend's agent and the session around it
(:mod:`rpc_registry.engine`), which the other functions call into, and
``shutdown`` ends it. Timeouts are seconds, ``0`` for none, ``-1`` for the
agent's default.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar, overload

import torch
from torch.distributed.distributed_c10d import Store
from torch.futures import Future
from typing_extensions import TypeVarTuple, Unpack

from . import autograd as _autograd
from . import engine as _engine
from . import rref as _rref
from . import slow_calls
from .constants import DEFAULT_SHUTDOWN_TIMEOUT, INSTALL_DEFAULT_BACKEND, UNSET_RPC_TIMEOUT
from .engine import WorkerRef as WorkerRef
from .engine import _current, _RpcState
from .errors import _name_of, check_operator_arguments
from .pickling import pickling_for_rpc as pickling_for_rpc
from .protocols import RpcBackendOptions, WorkerInfo
from .registry import _REGISTRY, BackendType, construct_rpc_backend_options, init_backend
from .rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT_S, rendezvous_store
from .rref import RRef
from .timeouts import checked_timeout

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "AllGatherStates",
    "enable_gil_profiling",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "method_factory",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

T = TypeVar("T")
_Ts = TypeVarTuple("_Ts")

_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9_:\-]+")
_MAX_NAME_LENGTH: Final = 128

_init_lock = threading.Lock()


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name={name!r}: must be a str such as 'worker1'")
    if len(name) >= _MAX_NAME_LENGTH or not _NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"name={name!r}: a worker name must be 1 to {_MAX_NAME_LENGTH - 1} characters, "
            "each a letter, digit, '_', ':' or '-'"
        )
    return name


def _choose_backend(backend: BackendType | None, options: RpcBackendOptions | None) -> BackendType:
    if backend is not None:
        return backend
    if options is not None:
        for candidate in BackendType:
            try:
                options_type = type(construct_rpc_backend_options(candidate))
            except Exception as exc:  # noqa: BLE001 - that backend is just not a candidate
                logger.debug("cannot build options of %r: %s", candidate, exc)
                continue
            if isinstance(options, options_type):
                if candidate.name != "TENSORPIPE":
                    logger.warning(
                        "init_rpc: no backend given; using %r, whose options were passed", candidate
                    )
                return candidate
        raise TypeError(
            f"Could not infer backend for options {options!r}: no registered backend builds "
            f"options of type {type(options).__qualname__}; pass backend= explicitly"
        )
    default = _REGISTRY.get("TENSORPIPE")
    if default is None:
        raise RuntimeError(
            "init_rpc: backend=None selects the default backend TENSORPIPE, which is not "
            f"installed; install it with {INSTALL_DEFAULT_BACKEND}, or pass "
            "backend=BackendType.<NAME> of a backend registered with register_backend()"
        )
    return default


def _rendezvous(
    options: RpcBackendOptions, rank: int, world_size: int | None
) -> tuple[Store, int, int | None]:
    timeout = getattr(options, "rendezvous_timeout", None)
    if timeout is None:
        timeout = DEFAULT_RENDEZVOUS_TIMEOUT_S
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(
            f"rpc_backend_options.rendezvous_timeout={timeout!r}: must be seconds > 0 (how long "
            f"init_rpc waits for the other workers; default {DEFAULT_RENDEZVOUS_TIMEOUT_S:g})"
        )
    return rendezvous_store(options.init_method, rank, world_size, options.rpc_timeout, float(timeout))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def init_rpc(
    name: str,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Start RPC on this worker: rendezvous, create the backend's agent, serve requests.

    ``backend`` defaults to the type of ``rpc_backend_options`` or, without
    options, to ``BackendType.TENSORPIPE`` (``pip install tensorpipe-backend``).
    ``world_size=None`` joins a dynamic group. Options default to the
    backend's with ``init_method="env://"`` (``MASTER_ADDR``, ``MASTER_PORT``).

    As torch's, a worker waits for the others of a static group for the
    rendezvous timeout, not ``rpc_timeout`` (the limit of one call): the
    options' ``rendezvous_timeout`` seconds when they have one, else 30
    minutes. Every few seconds of the wait a warning names the ranks still
    missing; at the end a ``TimeoutError`` names those that never arrived.

    Example::

        init_rpc("worker0", rank=0, world_size=2)
        rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        shutdown()
    """
    _check_name(name)
    # torch's wording first in both, which callers may match.
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(
            f"Argument backend must be a member of BackendType: backend={backend!r}; "
            "pass e.g. BackendType.TENSORPIPE"
        )
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError(
            "Argument rpc_backend_options must be an instance of RpcBackendOptions (options with "
            f"rpc_timeout and init_method): rpc_backend_options={rpc_backend_options!r}; build them "
            "with construct_rpc_backend_options() or the backend's options class"
        )
    if not _is_int(rank) or rank < -1:
        raise ValueError(f"rank={rank!r}: must be an int >= 0, or -1 to read RANK (env://)")
    if world_size is not None and (not _is_int(world_size) or world_size < 1):
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1, or None for a dynamic group")
    if world_size is not None and rank >= world_size:
        raise ValueError(f"rank={rank}: must be below world_size={world_size}")
    with _init_lock:
        if _engine._state is not None:
            raise RuntimeError("RPC is already initialized")
        # The agent's process (and the process groups beside it) exits cleanly even when one of
        # torch's threads frees a tensor after the script's last line.
        from join_core import install_exit_grace  # not at import: join_core is only needed here

        install_exit_grace()
        chosen = _choose_backend(backend, rpc_backend_options)
        options = rpc_backend_options or construct_rpc_backend_options(chosen)
        store, rank, world_size = _rendezvous(options, rank, world_size)
        agent = init_backend(
            chosen,
            store=store,
            name=name,
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options,
        )
        state = _RpcState(agent, _autograd.backward)
        _rref.set_context(state.rrefs)
        # Set before the first request runs: a called function may use RPC itself, and peers
        # that finished init_rpc first may have sent requests already.
        _engine._state = state
        try:
            agent.start(state.handle)
        except BaseException:
            _engine._state = None
            state.close()
            raise
        me = name
        slow_calls.set_asker(
            lambda callee, timeout: rpc_async(callee, slow_calls.handler_stacks, args=(me,), timeout=timeout)
        )
    logger.info("RPC initialized: %s (rank %d) on backend %r", name, rank, chosen)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop RPC on this worker.

    With ``graceful=True`` it first waits until every worker has called
    ``shutdown`` and no call is in flight, then releases this worker's RRefs
    and waits until their releases are done everywhere (at most ``timeout``
    seconds in all; ``0`` waits without limit), so no request is left
    without a reply and no owner frees a value a worker may still forward.
    """
    timeout = checked_timeout("timeout", timeout)
    with _init_lock:
        state = _current()
        try:
            if graceful:
                # Every worker first stops calling (as torch does): until then a handler here
                # may still forward one of this worker's RRefs, whose owner must keep the value.
                deadline = time.monotonic() + timeout if timeout > 0 else None
                state.agent.join(shutdown=False, timeout=timeout)
                state.rrefs.release_users()
                state.rrefs.flush(_left(deadline))
                state.agent.join(shutdown=True, timeout=_left(deadline))
        finally:
            slow_calls.set_asker(None)
            _engine._state = None
            _rref.set_context(None)
            state.close()


def _left(deadline: float | None) -> float:
    """Seconds to ``deadline`` for a timeout argument (``0``: none; at least 1 ms otherwise)."""
    return 0.0 if deadline is None else max(deadline - time.monotonic(), 0.001)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of worker ``worker_name``, or of this worker when it is None."""
    return _current().agent.get_worker_info(worker_name)


def _call_arguments(func: object, args: object, kwargs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` of a call to ``func``, checked (as is ``func``) before anything is sent."""
    _check_callable(func)
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        if not isinstance(args, list):
            raise TypeError(
                f"args={_short(args)} ({type(args).__name__}): must be a tuple of func's positional "
                "arguments; for one argument x pass args=(x,)"
            )
        args = tuple(args)
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise TypeError(
            f"kwargs={_short(kwargs)} ({type(kwargs).__name__}): must be a dict of func's keyword arguments"
        )
    else:
        kwargs = dict(kwargs)  # the caller may change its own once the call is on its way
    check_operator_arguments(func, args, kwargs)
    return args, kwargs


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_callable(func: object) -> None:
    if isinstance(func, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
        raise TypeError(
            f"func={_name_of(func)}: TorchScript functions are not supported as RPC targets "
            "(TorchScript is deprecated in torch); pass the plain Python function instead "
            "(the one decorated with @torch.jit.script)"
        )
    if not callable(func):
        raise TypeError(f"func={func!r}: must be callable (a function importable by the callee)")


def is_available() -> bool:
    """Whether RPC can be used: always, this package needs no compiled extension (torch's name)."""
    return True


def get_rpc_timeout() -> float:
    """The default timeout of calls on this worker, in seconds (the agent's ``rpc_timeout``)."""
    return _current().agent.rpc_timeout


def enable_gil_profiling(flag: bool) -> None:
    """torch's switch for measuring GIL wait times in its C++ agent.

    This package has no such measurement: ``flag=False`` (torch's default)
    is accepted, ``flag=True`` raises ``NotImplementedError``.
    """
    if flag:
        raise NotImplementedError(
            "enable_gil_profiling(True): rpc_registry does not measure GIL wait times; "
            "profile with torch.profiler or py-spy instead"
        )


class AllGatherStates:
    """The per-round state of an all-gather over RPC: what arrived, and the signal to go on."""

    def __init__(self) -> None:
        self.gathered_objects: dict[str, object] = {}
        self.proceed_signal: threading.Event = threading.Event()


def method_factory(method_name: str, docstring: str | None) -> Callable[..., Any]:
    """A function that calls ``RRef.<method_name>`` on its first argument, documented by ``docstring``."""

    def method(self: RRef[Any], *args: Any, **kwargs: Any) -> Any:
        return getattr(RRef, method_name)(self, *args, **kwargs)

    method.__name__ = method_name
    method.__doc__ = docstring
    return method


# With ``args`` and no ``kwargs``, or neither, type checkers check the
# arguments against ``func``; with ``kwargs`` they check only ``func``'s result.
@overload
def rpc_async(
    to: WorkerRef,
    func: Callable[[Unpack[_Ts]], T],
    args: tuple[Unpack[_Ts]],
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
@overload
def rpc_async(
    to: WorkerRef,
    func: Callable[[], T],
    args: None = None,
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
@overload
def rpc_async(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
@overload
def rpc_async(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    *,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
def rpc_async(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]:
    """Run ``func(*args, **kwargs)`` on worker ``to``; the future holds its result.

    ``timeout`` is in seconds: ``0`` waits without limit, ``-1`` uses the
    agent's default. Functions decorated with ``@async_execution`` reply
    when the future they return completes.
    """
    args, kwargs = _call_arguments(func, args, kwargs)
    state = _current()
    request = ("call", func, args, kwargs)
    return state.request(state.worker(to), request, state.resolve_timeout(timeout))


# With ``args`` and no ``kwargs``, or neither, type checkers check the
# arguments against ``func``; with ``kwargs`` they check only ``func``'s result.
@overload
def rpc_sync(
    to: WorkerRef,
    func: Callable[[Unpack[_Ts]], T],
    args: tuple[Unpack[_Ts]],
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
@overload
def rpc_sync(
    to: WorkerRef,
    func: Callable[[], T],
    args: None = None,
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
@overload
def rpc_sync(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
@overload
def rpc_sync(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    *,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
def rpc_sync(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result (see ``rpc_async``)."""
    args, kwargs = _call_arguments(func, args, kwargs)
    state = _current()
    request = ("call", func, args, kwargs)
    callee = state.worker(to)
    slow_calls.started_waiting(id(request), callee.name, _name_of(func))
    try:
        result: T = state.request_wait(callee, request, state.resolve_timeout(timeout))
    finally:
        slow_calls.stopped_waiting(id(request))
    return result


# With ``args`` and no ``kwargs``, or neither, type checkers check the
# arguments against ``func``; with ``kwargs`` they check only ``func``'s result.
@overload
def remote(
    to: WorkerRef,
    func: Callable[[Unpack[_Ts]], T],
    args: tuple[Unpack[_Ts]],
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]: ...
@overload
def remote(
    to: WorkerRef,
    func: Callable[[], T],
    args: None = None,
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]: ...
@overload
def remote(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]: ...
@overload
def remote(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    *,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]: ...
def remote(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]:
    """Run ``func`` on worker ``to`` and return an :class:`RRef` to the result it keeps.

    Returns at once; a creation that fails or times out is reported by the
    first ``to_here()``.
    """
    args, kwargs = _call_arguments(func, args, kwargs)
    state = _current()
    return state.remote(state.worker(to), func, args, kwargs, state.resolve_timeout(timeout))
