"""One worker's distributed autograd contexts: what was sent and received in each.

A context records, per RPC made inside it, the tensors that required grad:
on the sender as a *send* entry (the tensors themselves, still part of the
sender's graph), on the receiver as *recv* leaves (fresh leaf tensors that
stand for the sender's). The receiver's code gets each recv leaf through
:class:`RecvRpc`, torch's ``RecvRpcBackward``: a tensor with a gradient
function, which may be a root of backward or be changed in place. Backward
(in :mod:`rpc_registry.autograd`) computes gradients of recv leaves on one worker and hands them to the matching send
entry on the sender, which carries on there. Gradients of ordinary leaves are
accumulated per context, never in ``.grad``.

The wire form of a message sent inside a context is a header ahead of the
normal payload: ``(context id, sender id, send id, indices of the tensors
that require grad)``.
"""

from __future__ import annotations

import itertools
import pickle
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import torch

from .functions import is_async_execution, mark_async_execution
from .protocols import Message, WorkerInfo

__all__ = ["GradContainer", "GradContext", "RecvInfo"]

T = TypeVar("T")

WITH_GRAD: Final = 2
"""First payload byte of a message that carries a context header."""

_LENGTH: Final = struct.Struct("<I")
# A context id is the creating worker's id in the top 16 bits and a counter below, as torch's.
_ID_BITS: Final = 48


@dataclass(frozen=True)
class RecvInfo:
    """Where a recv leaf came from: the sender and the position in its send entry."""

    sender: WorkerInfo
    send_id: int
    index: int


class RecvRpc(torch.autograd.Function):
    """The identity from a recv leaf to the tensor the receiver's code gets (no copy)."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor) -> torch.Tensor:
        return leaf.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


@dataclass
class GradContext:
    """One context on one worker."""

    context_id: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    sends: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # Recv leaves by identity; the tensor is kept so that its id stays unique.
    recvs: dict[int, tuple[torch.Tensor, RecvInfo]] = field(default_factory=dict)
    grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    workers: dict[str, WorkerInfo] = field(default_factory=dict)

    def accumulate(self, tensor: torch.Tensor, grad: torch.Tensor, steal: bool = False) -> None:
        """Add ``grad`` to the gradient of ``tensor`` kept in this context.

        The first gradient is copied unless ``steal``: then it is kept as it is
        (the context never changes a gradient in place).
        """
        with self.lock:
            known = self.grads.get(tensor)
            if known is not None:
                self.grads[tensor] = known + grad
            else:
                self.grads[tensor] = grad.detach() if steal else grad.detach().clone()

    def touched(self, worker: WorkerInfo) -> None:
        """Remember that ``worker`` holds this context too (it is released there as well)."""
        with self.lock:
            self.workers[worker.name] = worker


class GradContainer:
    """The contexts of one worker and the thread-local current one."""

    def __init__(self, me: WorkerInfo, worker_by_id: Callable[[int], WorkerInfo]) -> None:
        self.me = me
        self._worker_by_id = worker_by_id
        self._lock = threading.Lock()
        self._contexts: dict[int, GradContext] = {}
        self._ids = itertools.count()
        self._sends = itertools.count()
        self._local = threading.local()
        if not 0 <= me.id < 1 << 16:
            raise ValueError(f"worker id {me.id}: distributed autograd needs ids below 65536")

    # Lifecycle.
    def new_context(self) -> GradContext:
        """Create a context for this thread (one at a time per thread, as torch)."""
        if self.current_id() is not None:
            raise RuntimeError(
                f"Already have an autograd context id for this thread ({self.current_id()}); "
                "leave the enclosing dist_autograd.context() first"
            )
        context_id = (self.me.id << _ID_BITS) | next(self._ids)
        context = GradContext(context_id)
        with self._lock:
            self._contexts[context_id] = context
        self._local.context_id = context_id
        return context

    def clear_current(self) -> None:
        """This thread leaves its context."""
        self._local.context_id = None

    def current_id(self) -> int | None:
        """This thread's context id, if it is inside one."""
        context_id: int | None = getattr(self._local, "context_id", None)
        return context_id

    def get(self, context_id: int) -> GradContext:
        """The context ``context_id``, or torch's error when this worker has none."""
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise RuntimeError(
                f"Could not find autograd context with id: {context_id} on {self.me.name}: "
                "it has ended here, or no call of that context reached this worker"
            )
        return context

    def release(self, context_id: int) -> GradContext | None:
        """Forget ``context_id``; the context it was (``None`` when already released)."""
        with self._lock:
            return self._contexts.pop(context_id, None)

    def count(self) -> int:
        """How many contexts this worker holds."""
        with self._lock:
            return len(self._contexts)

    def clear(self) -> None:
        """Forget every context (RPC shuts down)."""
        with self._lock:
            self._contexts.clear()

    @contextmanager
    def entered(self, context_id: int | None) -> Iterator[None]:
        """Run the body inside ``context_id`` (a request that arrived with it), or outside any."""
        previous = self.current_id()
        self._local.context_id = context_id
        try:
            yield
        finally:
            self._local.context_id = previous

    def bind(self, context_id: int, func: Callable[..., T]) -> Callable[..., T]:
        """``func`` run inside ``context_id``; an ``async_execution`` mark is kept."""

        def in_context(*args: Any, **kwargs: Any) -> T:
            with self.entered(context_id):
                return func(*args, **kwargs)

        if is_async_execution(func):
            mark_async_execution(in_context)
        return in_context

    # Wire.
    def on_send(self, context_id: int, message: Message, dest: WorkerInfo, force: bool) -> Message:
        """``message`` with the header of ``context_id``; the tensors requiring grad are recorded.

        Without such tensors the message goes out unchanged, unless ``force``
        (a request whose reply may carry gradients, e.g. an RRef fetch).
        """
        indices = [i for i, tensor in enumerate(message.tensors) if tensor.requires_grad]
        if not indices and not force:
            return message
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            return message  # a reply after the context ended: nothing to record it in
        send_id = next(self._sends)
        if indices:
            with context.lock:
                context.sends[send_id] = [message.tensors[i] for i in indices]
        context.touched(dest)
        header = pickle.dumps((context_id, self.me.id, send_id, indices), pickle.HIGHEST_PROTOCOL)
        payload = bytes((WITH_GRAD,)) + _LENGTH.pack(len(header)) + header + message.payload
        tensors = tuple(t.detach() if t.requires_grad else t for t in message.tensors)
        return Message(payload, tensors)

    def on_receive(self, message: Message, create: bool) -> tuple[Message, int | None]:
        """The inner message and its context id; tensors that required grad come from recv leaves.

        ``create``: a request creates the context here if it is new; a reply
        for a context that has ended is taken without gradients.
        """
        (size,) = _LENGTH.unpack_from(message.payload, 1)
        start = 1 + _LENGTH.size
        context_id, sender_id, send_id, indices = pickle.loads(message.payload[start : start + size])
        inner = message.payload[start + size :]
        with self._lock:
            context = self._contexts.get(context_id)
            if context is None and create:
                context = self._contexts[context_id] = GradContext(context_id)
        if context is None:
            return Message(inner, message.tensors), None
        sender = self._worker_by_id(sender_id)
        context.touched(sender)
        tensors = list(message.tensors)
        with context.lock, torch.enable_grad():
            for position, index in enumerate(indices):
                leaf = tensors[index].detach().requires_grad_()
                context.recvs[id(leaf)] = (leaf, RecvInfo(sender, send_id, position))
                tensors[index] = RecvRpc.apply(leaf)  # type: ignore[no-untyped-call]
        return Message(inner, tuple(tensors)), context_id
