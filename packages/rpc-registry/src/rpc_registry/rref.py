"""Remote references with reference counting, independent of the backend.

The owner of a value keeps it while any user holds a reference. Every user
reference is a *fork* registered with the owner; when a user's ``RRef`` is
garbage collected its fork is deleted on the owner, and the owner frees the
value once no fork and no local ``RRef`` is left.

Before an ``RRef`` is sent to a third worker, the new fork is registered with
the owner, so the owner always knows a fork before anyone can use or delete
it. Agents deliver the messages of one peer in order, which keeps a fork's
creation ahead of its deletion.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import torch
from torch.futures import Future
from typing_extensions import Protocol

from .errors import not_initialized
from .functions import async_execution, is_async_execution
from .protocols import WorkerInfo

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["RRef"]

T = TypeVar("T")
# An RRef only hands its value out: RRef[Parameter] is an RRef[Tensor].
T_co = TypeVar("T_co", covariant=True)
RRefId = tuple[int, int]
ForkId = tuple[int, int]
WireRRef = tuple[WorkerInfo, RRefId, ForkId | None]


class RRefRuntime(Protocol):
    """What RRefs need from the RPC layer (implemented in :mod:`rpc_registry.engine`)."""

    @property
    def me(self) -> WorkerInfo:
        """This worker."""
        ...

    def resolve_timeout(self, timeout: float) -> float:
        """Seconds to wait for ``timeout`` (``-1``: the agent's default; ``0``: none)."""
        ...

    def request(self, to: WorkerInfo, request: tuple[object, ...], timeout: float) -> Future[Any]:
        """Send an internal request; the future holds the decoded reply."""
        ...

    def remote(
        self,
        to: WorkerInfo,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> RRef[Any]:
        """Run ``func`` on ``to`` and return a reference to its result."""
        ...

    def backward(self, context_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        """Distributed autograd's backward pass of ``roots`` in context ``context_id``
        (:func:`rpc_registry.autograd.backward`, which builds on this module)."""
        ...


def wait_for(fut: Future[T], timeout: float, what: str) -> T:
    """``fut``'s value, waiting at most ``timeout`` seconds (``0``: no limit)."""
    if timeout > 0 and not fut.done():
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise TimeoutError(f"{what}: not done within {timeout:g} s; pass a larger timeout, or 0 for none")
    return fut.wait()


def completed(value: T) -> Future[T]:
    """A future that already holds ``value``."""
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def fail(fut: Future[Any], exc: BaseException) -> None:
    """Complete ``fut`` with the error ``exc``."""
    fut.set_exception(exc)


def copy_outcome(src: Future[T], dst: Future[T]) -> None:
    """Complete ``dst`` with ``src``'s value or error (keeping the error's type)."""
    try:
        value = src.value()
    except Exception as exc:  # noqa: BLE001 - the error is handed on, not swallowed
        fail(dst, exc)
    else:
        dst.set_result(value)


@dataclass
class _Owned:
    value: Future[Any]
    forks: set[ForkId] = field(default_factory=set)
    local_refs: int = 0


_Task = tuple[Literal["user"], WorkerInfo, RRefId, ForkId] | tuple[Literal["owner"], RRefId]


class RRefContext:
    """One worker's RRef bookkeeping: the values it owns and the forks it holds."""

    def __init__(self, runtime: RRefRuntime) -> None:
        self.runtime = runtime
        self.me: WorkerInfo = runtime.me
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._owned: dict[RRefId, _Owned] = {}
        self._users: weakref.WeakValueDictionary[ForkId, RRef[Any]] = weakref.WeakValueDictionary()
        # RRef.__del__ may run inside any frame, even one holding an agent's or
        # this context's lock, so releases are queued to a thread of their own.
        self._tasks: queue.SimpleQueue[_Task | threading.Event | None] = queue.SimpleQueue()
        self._in_flight: list[Future[Any]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rpc-registry-rref", daemon=True)
        self._thread.start()

    def new_id(self) -> tuple[int, int]:
        """A globally unique id: this worker's id and a local counter."""
        return (self.me.id, next(self._ids))

    # Owner side.
    def create_owned(self, rref_id: RRefId, fork_id: ForkId | None) -> Future[Any]:
        """Start owning ``rref_id`` for one user fork or, with ``fork_id=None``, a local RRef."""
        entry = _Owned(Future())
        if fork_id is None:
            entry.local_refs = 1
        else:
            entry.forks.add(fork_id)
        with self._lock:
            self._owned[rref_id] = entry
        return entry.value

    def add_fork(self, rref_id: RRefId, fork_id: ForkId) -> None:
        """Record a new user of ``rref_id``."""
        with self._lock:
            self._entry_locked(rref_id).forks.add(fork_id)

    def delete_fork(self, rref_id: RRefId, fork_id: ForkId) -> None:
        """Forget a user of ``rref_id``; free the value when it was the last reference."""
        with self._lock:
            entry = self._entry_locked(rref_id)
            entry.forks.discard(fork_id)
            self._maybe_free_locked(rref_id, entry)

    def value_of(self, rref_id: RRefId) -> Future[Any]:
        """The future of an owned value."""
        with self._lock:
            return self._entry_locked(rref_id).value

    def owned_count(self) -> int:
        """How many values this worker owns now."""
        with self._lock:
            return len(self._owned)

    def _entry_locked(self, rref_id: RRefId) -> _Owned:
        entry = self._owned.get(rref_id)
        if entry is None:
            raise LookupError(
                f"RRef {rref_id} is not owned by {self.me.name} (any more): "
                "its last reference was already released"
            )
        return entry

    def _maybe_free_locked(self, rref_id: RRefId, entry: _Owned) -> None:
        if not entry.forks and entry.local_refs == 0:
            del self._owned[rref_id]
            logger.debug("%s released the value of RRef %s", self.me.name, rref_id)

    # Wire format.
    def to_wire(
        self,
        rref: RRef[Any],
        dest: WorkerInfo,
        forks: list[tuple[WorkerInfo, RRefId, ForkId]],
        reply: bool = False,
    ) -> WireRRef:
        """Describe ``rref`` for ``dest``; forks to register with other owners go to ``forks``.

        ``reply``: the message answers a request of ``dest``.
        """
        if rref._ctx is not self:
            raise RuntimeError(f"{rref!r} belongs to an RPC session that was shut down")
        if dest == rref._owner and not reply:
            # A request keeps the sender's reference alive until its reply, so the owner
            # decodes this message before any deletion from the sender. A reply has no
            # answer to wait for: it carries a fork registered with its owner like any other.
            return (rref._owner, rref._rref_id, None)
        fork_id = self.new_id()
        if rref._owner == self.me:
            self.add_fork(rref._rref_id, fork_id)
        else:
            forks.append((rref._owner, rref._rref_id, fork_id))
        return (rref._owner, rref._rref_id, fork_id)

    def from_wire(self, wire: WireRRef) -> RRef[Any]:
        """Rebuild an RRef that arrived in a message."""
        owner, rref_id, fork_id = wire
        if owner == self.me:
            with self._lock:
                entry = self._entry_locked(rref_id)
                entry.local_refs += 1
                if fork_id is not None:
                    entry.forks.discard(fork_id)
            return RRef._make(self, owner, rref_id, None, None)
        if fork_id is None:
            raise RuntimeError(f"RRef {rref_id} of {owner.name} arrived without a fork id")
        return self.track_user(RRef._make(self, owner, rref_id, fork_id, None))

    # User side.
    def track_user(self, rref: RRef[T]) -> RRef[T]:
        """Remember a user RRef so that shutdown can release it."""
        assert rref._fork_id is not None
        self._users[rref._fork_id] = rref
        return rref

    def released(self, rref: RRef[Any]) -> None:
        """Called from ``RRef.__del__``: queue the release of its reference."""
        if self._closed:
            return
        if rref._fork_id is None:
            self._tasks.put(("owner", rref._rref_id))
            return
        task: _Task = ("user", rref._owner, rref._rref_id, rref._fork_id)
        created = rref._created
        if created is not None and not created.done():
            # remote() may still be sending the creation (its arguments' forks go first): the
            # deletion must not reach the owner before it, or the owner keeps the value for good.
            created.add_done_callback(lambda _: self._tasks.put(task))
        else:
            self._tasks.put(task)

    def release_users(self) -> None:
        """Release every user RRef still alive (graceful shutdown)."""
        for rref in list(self._users.values()):
            if not rref._released:
                rref._released = True
                self.released(rref)

    def flush(self, timeout: float) -> None:
        """Wait until queued releases reached their owners (``timeout=0``: no limit)."""
        marker = threading.Event()
        self._tasks.put(marker)
        deadline = time.monotonic() + timeout if timeout > 0 else None
        if not marker.wait(timeout if timeout > 0 else None):
            raise TimeoutError(f"RRef releases of {self.me.name}: not sent within {timeout:g} s")
        with self._lock:
            in_flight, self._in_flight = self._in_flight, []
        for fut in in_flight:
            left = 0.0 if deadline is None else max(deadline - time.monotonic(), 1e-3)
            try:
                wait_for(fut, left, f"release of an RRef by {self.me.name}")
            except Exception as exc:  # noqa: BLE001 - shutdown goes on; the owner keeps the value
                logger.warning("%s: an RRef release failed: %s", self.me.name, exc)

    def close(self) -> None:
        """Stop the release thread; later releases are dropped."""
        self._closed = True
        self._tasks.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if isinstance(task, threading.Event):
                task.set()
                continue
            try:
                self._release(task)
            except Exception as exc:  # noqa: BLE001 - this thread must outlive one bad release
                logger.warning("%s: could not release an RRef: %s", self.me.name, exc)
            # The loop's frame must not keep the last task's objects (and values) alive.
            del task

    def _release(self, task: _Task) -> None:
        if task[0] == "owner":
            with self._lock:
                entry = self._owned.get(task[1])
                if entry is not None:
                    entry.local_refs -= 1
                    self._maybe_free_locked(task[1], entry)
            return
        _, owner, rref_id, fork_id = task
        fut = self.runtime.request(owner, ("delete", rref_id, fork_id), self.runtime.resolve_timeout(-1))
        with self._lock:
            self._in_flight = [f for f in self._in_flight if not f.done()]
            self._in_flight.append(fut)


_CONTEXT: RRefContext | None = None


def _context() -> RRefContext:
    if _CONTEXT is None:
        raise not_initialized(rref=True)
    return _CONTEXT


def set_context(ctx: RRefContext | None) -> None:
    """Install the context of the running RPC session (``None`` after shutdown)."""
    global _CONTEXT
    _CONTEXT = ctx


class RRef(Generic[T_co]):
    """A reference to a value owned by one worker of the RPC group.

    ``RRef(value)`` makes this worker the owner of ``value``; ``remote()``
    returns RRefs owned by other workers. The owner frees the value once no
    worker holds a reference to it.

    Example::

        rref = remote("worker1", torch.add, args=(torch.ones(2), 1))
        rref.to_here()                      # tensor([2., 2.])
        rref.rpc_sync().size()              # runs Tensor.size on worker1
    """

    __slots__ = (
        "__weakref__",
        "_attributes",
        "_created",
        "_ctx",
        "_fork_id",
        "_owner",
        "_released",
        "_rref_id",
    )

    _ctx: RRefContext
    _owner: WorkerInfo
    _rref_id: RRefId
    _fork_id: ForkId | None
    _created: Future[Any] | None
    _released: bool
    _attributes: set[str]

    def __init__(self, value: T_co, type_hint: object = None) -> None:
        """Make this worker the owner of ``value``.

        ``type_hint`` is accepted for torch's signature; torch gives it to the
        TorchScript compiler, which this package does not use.
        """
        ctx = _context()
        rref_id = ctx.new_id()
        ctx.create_owned(rref_id, None).set_result(value)
        self._init(ctx, ctx.me, rref_id, None, None)

    def _init(
        self,
        ctx: RRefContext,
        owner: WorkerInfo,
        rref_id: RRefId,
        fork_id: ForkId | None,
        created: Future[Any] | None,
    ) -> None:
        self._ctx = ctx
        self._owner = owner
        self._rref_id = rref_id
        self._fork_id = fork_id
        self._created = created
        self._released = False
        self._attributes = set()  # names the value is known to have (see _check_attribute)

    @classmethod
    def _make(
        cls,
        ctx: RRefContext,
        owner: WorkerInfo,
        rref_id: RRefId,
        fork_id: ForkId | None,
        created: Future[Any] | None,
    ) -> RRef[Any]:
        rref: RRef[Any] = cls.__new__(cls)
        rref._init(ctx, owner, rref_id, fork_id, created)
        return rref

    def owner(self) -> WorkerInfo:
        """The worker that owns the value."""
        return self._owner

    def owner_name(self) -> str:
        """The name of the worker that owns the value."""
        return self._owner.name

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._fork_id is None

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has acknowledged this reference."""
        created = self._created
        if created is None:
            return True
        if not created.done():
            return False
        try:
            created.value()
        except Exception:  # noqa: BLE001 - any failure means "not confirmed"
            return False
        return True

    def local_value(self) -> T_co:
        """The value itself; only on the owner."""
        if not self.is_owner():
            me, owner = self._ctx.me, self._owner
            # torch's wording first, which callers may match.
            raise RuntimeError(
                f"For {_guid_pair(self._rref_id, self._fork_id)}, can't call localValue() on user "
                f"WorkerInfo(id={me.id}, name={me.name}). Call it on owner "
                f"WorkerInfo(id={owner.id}, name={owner.name}), or call to_here() to fetch a copy"
            )
        timeout = self._ctx.runtime.resolve_timeout(-1)
        value: T_co = wait_for(self._ctx.value_of(self._rref_id), timeout, f"value of {self!r}")
        return value

    def to_here(self, timeout: float = -1.0) -> T_co:
        """A copy of the value, fetched from the owner (``timeout``: ``-1`` default, ``0`` none)."""
        runtime = self._ctx.runtime
        seconds = runtime.resolve_timeout(timeout)
        if self.is_owner():
            value: T_co = wait_for(self._ctx.value_of(self._rref_id), seconds, f"value of {self!r}")
            return value
        self._wait_created(seconds)
        fetched: T_co = runtime.request(self._owner, ("fetch", self._rref_id), seconds).wait()
        return fetched

    def _wait_created(self, timeout: float) -> None:
        """Wait until the owner holds the value (a failed creation is raised here, as torch does).

        A message that carries forks of other RRefs waits for their owners
        before it goes out, so a later request could overtake the creation.
        """
        if self._created is not None:
            wait_for(self._created, timeout, f"creation of {self!r} on {self._owner.name}")

    def _check_attribute(self, name: str, timeout: float) -> None:
        """Raise ``AttributeError`` here if the value has no attribute ``name`` (asks the owner once).

        A proxy's ``remote()`` returns before the call runs, so without this a
        misspelt method would only fail in ``to_here()``; torch raises at once.
        """
        if name in self._attributes:
            return
        if self.is_owner():
            missing = _missing_attribute(self, name)
        else:
            request: tuple[object, ...] = ("call", _missing_attribute, (self, name), {})
            missing = self._ctx.runtime.request(self._owner, request, timeout).wait()
        if missing is not None:
            raise AttributeError(
                f"{missing!r} object has no attribute {name!r}: the value of {self!r} on "
                f"{self._owner.name} has no method {name}"
            )
        self._attributes.add(name)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Backward from the value (a scalar tensor) as the root, on its owner.

        With ``dist_autograd_ctx_id`` it is a distributed backward pass of
        that context (see :mod:`rpc_registry.autograd`); without it, a local
        ``Tensor.backward`` on the owner, which must be this worker.
        """
        if dist_autograd_ctx_id == -1:
            if not self.is_owner():
                # torch's wording first, which callers may match.
                raise RuntimeError(
                    f"User RRefs require 'dist_autograd_ctx_id' to be specified: {self!r}.backward() "
                    f"runs a local backward pass only on the owner ({self._owner.name}); pass the "
                    "context id of dist_autograd.context() for a distributed one"
                )
            _backward_value(self, -1, retain_graph)
            return
        timeout = self._ctx.runtime.resolve_timeout(-1)
        if self.is_owner():
            _backward_value(self, dist_autograd_ctx_id, retain_graph)
        else:
            self._wait_created(timeout)
            self._ctx.runtime.request(
                self._owner,
                ("call", _backward_value, (self, dist_autograd_ctx_id, retain_graph), {}),
                timeout,
            ).wait()

    def rpc_sync(self, timeout: float = -1.0) -> RRefProxy:
        """Proxy whose methods run ``rpc_sync`` of the value's method on the owner."""
        return RRefProxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> RRefProxy:
        """Proxy whose methods run ``rpc_async`` of the value's method on the owner. A method
        returns its future at once, also while the value is still being created: the call goes
        out once it is (``timeout`` counting from the method's call)."""
        return RRefProxy(self, "async", timeout)

    def remote(self, timeout: float = -1.0) -> RRefProxy:
        """Proxy whose methods run ``remote`` of the value's method on the owner."""
        return RRefProxy(self, "remote", timeout)

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(owner={self._owner.name!r}, id={self._rref_id})"

    def __str__(self) -> str:
        if self._fork_id is None:
            return f"OwnerRRef({_guid(self._rref_id)})"
        return f"UserRRef(RRefId = {_guid(self._rref_id)}, ForkId = {_guid(self._fork_id)})"

    def __reduce__(self) -> Any:
        # torch's wording first, which callers may match.
        raise RuntimeError(
            f"Can not pickle rref in python pickler: {self!r} can only be pickled by the RPC "
            "layer, as an argument or result of rpc_sync, rpc_async or remote"
        )

    def __del__(self) -> None:
        try:
            if not self._released:
                self._released = True
                self._ctx.released(self)
        except AttributeError:  # __init__ failed before the fields were set
            pass


class RRefProxy:
    """Calls methods of an RRef's value on its owner; returned by ``RRef.rpc_sync()`` & co."""

    def __init__(self, rref: RRef[Any], mode: Literal["sync", "async", "remote"], timeout: float):
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            runtime = rref._ctx.runtime
            seconds = runtime.resolve_timeout(timeout)
            payload = (_invoke_rref_method, (rref, name, *args), kwargs)
            if mode == "async":
                # Sent once the owner has the RRef (the encoder waits for the creations of
                # the RRefs in a request), in this thread's autograd context, timed from now.
                return runtime.request(rref._owner, ("call", *payload), seconds)
            rref._wait_created(seconds)
            if mode == "remote":
                rref._check_attribute(name, seconds)
                return runtime.remote(rref._owner, *payload, seconds)
            return runtime.request(rref._owner, ("call", *payload), seconds).wait()

        return call


def _guid(ids: tuple[int, int]) -> str:
    return f"GloballyUniqueId(created_on={ids[0]}, local_id={ids[1]})"


def _guid_pair(rref_id: RRefId, fork_id: ForkId | None) -> str:
    return f"UserRRef(rref_id={_guid(rref_id)}, fork_id={_guid(fork_id or rref_id)})"


def _backward_value(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    value = rref.local_value()
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(
            f"RRef should contain a tensor for .backward(), but {rref!r} holds {type(value).__qualname__}"
        )
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
        return
    rref._ctx.runtime.backward(context_id, [value], retain_graph)


def _missing_attribute(rref: RRef[Any], name: str) -> str | None:
    """The type name of ``rref``'s value if it lacks attribute ``name``, else None (run on the owner)."""
    value = rref.local_value()
    return None if hasattr(value, name) else type(value).__qualname__


@async_execution
def _invoke_rref_method(rref: RRef[Any], name: str, *args: Any, **kwargs: Any) -> Future[Any]:
    method = getattr(rref.local_value(), name)
    if is_async_execution(method):
        result: Future[Any] = method(*args, **kwargs)
        return result
    return completed(method(*args, **kwargs))
