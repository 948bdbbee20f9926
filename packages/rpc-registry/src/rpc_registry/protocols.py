"""The seam between the RPC API and its backends: Protocols and small values.

A backend provides two handlers. The options handler builds an
:class:`RpcBackendOptions`; the init handler takes a store from the rendezvous
and returns an :class:`RpcAgent`. The agent only moves :class:`Message` objects
between workers; everything else (pickling, RRef reference counting,
``async_execution``, the meaning of timeouts) is done once by
:mod:`rpc_registry.engine` on top of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.distributed.distributed_c10d import Store
from torch.futures import Future
from typing_extensions import Protocol, runtime_checkable

from .constants import DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT_SEC

_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9_:\-]+")
_MAX_NAME_LENGTH: Final = 128


@dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC group: its unique ``name`` and its ``id`` (the rank).

    Names are 1 to 127 letters, digits, ``_``, ``:`` or ``-``, as torch's.
    """

    name: str
    id: int

    def __post_init__(self) -> None:
        # RuntimeError and torch's phrases: code written against torch matches them.
        if not self.name:
            raise RuntimeError("WorkerInfo(name=''): Worker name must be non-empty, e.g. 'worker1'")
        if len(self.name) >= _MAX_NAME_LENGTH:
            raise RuntimeError(
                f"WorkerInfo(name={self.name[:20]!r}...): Worker name must be shorter than "
                f"{_MAX_NAME_LENGTH} characters (it has {len(self.name)})"
            )
        if not _NAME_PATTERN.fullmatch(self.name):
            raise RuntimeError(
                f"WorkerInfo(name={self.name!r}): Worker name must match {_NAME_PATTERN.pattern} "
                "(letters, digits, '_', ':' or '-')"
            )


@dataclass(frozen=True)
class Message:
    """What an agent carries: a pickled ``payload`` and the ``tensors`` it refers to.

    Tensors travel beside the payload so that a backend can move them without
    copying them through pickle (and, for devices, with its own transport).
    """

    payload: bytes
    tensors: tuple[torch.Tensor, ...] = ()


RequestHandler = Callable[[WorkerInfo, Message], "Future[Message]"]
"""Called by an agent for every incoming request; its future holds the reply.

The future never completes with an error: failures of the called function are
encoded in the reply ``Message``. An error means the request itself could not
be handled, and the agent should report it to the caller as a transport error.
"""


@runtime_checkable
class RpcBackendOptions(Protocol):
    """Options every backend accepts (backends add their own fields).

    Any object with these two attributes is one (a backend's own options
    class need not derive from this). As torch's class, it may also be
    instantiated or subclassed; a subclass calls this ``__init__`` and may
    set the attributes in its own::

        class FileOptions(RpcBackendOptions):
            def __init__(self, path: str) -> None:
                RpcBackendOptions.__init__(self)
                self.init_method = f"file://{path}"
    """

    #: Default timeout of a call in seconds (``0``: no timeout).
    rpc_timeout: float
    #: URL for the rendezvous, e.g. ``env://`` or ``tcp://host:port``.
    init_method: str

    def __init__(
        self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC, init_method: str = DEFAULT_INIT_METHOD
    ) -> None:
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method


class RpcAgent(Protocol):
    """Moves messages between workers; returned by a backend's init handler.

    Contract: the agent calls the request handler for the messages from one
    peer in the order that peer sent them (as one TCP stream would), so that
    reference-counting messages are never reordered. Calls to oneself never
    reach the agent; the API handles them in process.

    An agent may also have ``handler_may_block = True``: it promises to call
    the handler on a thread that may block without stalling the agent, and the
    API then runs the called function in the handler itself (no hop to its own
    worker threads). Without the attribute, the handler only decodes the
    request and schedules the call. An agent may also have
    ``send_then(to, message, timeout, callback)``: ``send`` that calls
    ``callback`` exactly once with the reply ``Message`` or the error instead
    of completing a future; the API uses it for plain calls and relies on the
    agent for their timeout (a ``TimeoutError`` after ``timeout`` seconds,
    none when it is 0) and for failing them when it shuts down. Likewise an
    optional ``send_wait(to, message, timeout)`` returns the reply
    ``Message`` or raises the error; ``rpc_sync`` uses it for plain calls, so
    that an agent can read the reply in the waiting thread.
    """

    @property
    def rpc_timeout(self) -> float:
        """The default timeout in seconds that ``timeout=-1`` stands for."""
        ...

    def start(self, handler: RequestHandler) -> None:
        """Begin delivering incoming requests to ``handler``."""
        ...

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """The named worker's info, or this worker's when ``worker_name`` is None."""
        ...

    def get_worker_infos(self) -> list[WorkerInfo]:
        """All workers currently known to this agent, this one included."""
        ...

    def send(self, to: WorkerInfo, message: Message, timeout: float) -> Future[Message]:
        """Send a request; the future holds the reply message.

        ``timeout`` is in seconds, ``0`` meaning none. The API enforces it on
        its side too; the agent may use it to drop the request's state.
        """
        ...

    def sync(self) -> None:
        """Block until every worker has called ``sync`` (a barrier)."""
        ...

    def join(self, shutdown: bool = False, timeout: float = 0) -> None:
        """Wait until all workers are done sending; ``timeout=0`` waits without limit."""
        ...

    def shutdown(self) -> None:
        """Stop the agent and release its resources; no message is handled after."""
        ...


@runtime_checkable
class ConstructRpcBackendOptionsHandler(Protocol):
    """Builds a backend's options; every extra keyword must reach the options.

    Handlers may declare their own keywords (``device_maps=None``, ...) after
    the two that every backend takes.
    """

    def __call__(self, rpc_timeout: float, init_method: str, *args: Any, **kwargs: Any) -> RpcBackendOptions:
        """Return the options for ``rpc_timeout`` and ``init_method`` plus ``kwargs``."""
        ...


@runtime_checkable
class InitBackendHandler(Protocol):
    """Creates the backend's agent once the rendezvous gave a store."""

    def __call__(
        self,
        store: Store,
        name: str,
        rank: int,
        world_size: int | None,
        rpc_backend_options: RpcBackendOptions,
    ) -> RpcAgent:
        """Return a started-up agent for worker ``name`` (``world_size=None``: dynamic group)."""
        ...


@runtime_checkable
class BackendPlugin(Protocol):
    """What an entry point of group ``rpc_registry.backends`` gives (or returns when called)."""

    @property
    def name(self) -> str:
        """The backend's name, e.g. ``"TENSORPIPE"``; it must equal the entry point's name."""
        ...

    @property
    def construct_rpc_backend_options_handler(self) -> ConstructRpcBackendOptionsHandler:
        """The backend's options handler."""
        ...

    @property
    def init_backend_handler(self) -> InitBackendHandler:
        """The backend's init handler."""
        ...
