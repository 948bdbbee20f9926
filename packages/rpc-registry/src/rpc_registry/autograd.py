"""Distributed autograd: ``torch.distributed.autograd``'s API on top of any RPC backend.

Inside ``with context() as context_id:`` every RPC records the tensors it
sends and receives that require grad, on both workers (see
:mod:`rpc_registry.grad_contexts`). ``backward(context_id, roots)`` runs the
local graph and, through RPC, the parts on the workers that computed them,
nested calls included. Gradients of leaf tensors are kept per context and
per worker, read with :func:`get_gradients`; ``.grad`` is left alone.

Example::

    import rpc_registry.autograd as dist_autograd

    with dist_autograd.context() as context_id:
        t1 = torch.rand(3, 3, requires_grad=True)
        loss = rpc_registry.rpc_sync("worker1", torch.mul, args=(t1, 2)).sum()
        dist_autograd.backward(context_id, [loss])
        dist_autograd.get_gradients(context_id)[t1]  # all 2s
"""

from __future__ import annotations

import collections
import logging
import threading
from types import TracebackType
from typing import Any

import torch
from torch.futures import Future

from . import api
from .functions import async_execution
from .grad_contexts import GradContext
from .protocols import WorkerInfo
from .rref import completed, fail

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["DistAutogradContext", "backward", "context", "get_gradients", "is_available", "running_backward"]

DistAutogradContext = GradContext
"""torch's name of the type of one distributed autograd context on one worker
(:class:`~rpc_registry.grad_contexts.GradContext`)."""

# The context whose backward pass this thread runs, while it runs it.
_running = threading.local()


def is_available() -> bool:
    """Distributed autograd is always available (it needs no compiled extension)."""
    return True


class context:
    """A distributed autograd context; ``with`` yields its id.

    Calls made in the ``with`` body (on this thread) record their tensors for
    :func:`backward`. On exit the context is released here and on every
    worker it reached.
    """

    def __init__(self) -> None:
        self._context_id: int | None = None

    def __enter__(self) -> int:
        state = api._current()
        self._context_id = state.grad.new_context().context_id
        return self._context_id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        context_id, self._context_id = self._context_id, None
        state = api._state
        if state is None or context_id is None:
            return  # RPC shut down inside the body: its contexts are gone with it
        state.grad.clear_current()
        released = state.grad.release(context_id)
        if released is None:
            return
        try:
            _release_on_workers(state, released).wait()
        except Exception as exc:  # noqa: BLE001 - the body's outcome must not be masked
            logger.warning("releasing autograd context %d on its workers failed: %s", context_id, exc)


def _release_on_workers(state: api._RpcState, released: GradContext) -> Future[list[Future[Any]]]:
    timeout = state.resolve_timeout(-1)
    futures = [
        state.request(worker, ("call", _release_here, (released.context_id,), {}), timeout, in_context=False)
        for worker in released.workers.values()
        if worker.name != state.me.name
    ]
    return torch.futures.collect_all(futures)


@async_execution
def _release_here(context_id: int) -> Future[None]:
    """Release ``context_id`` on this worker and on the workers it reached from here."""
    state = api._current()
    released = state.grad.release(context_id)
    if released is None:
        return completed(None)
    done: Future[None] = Future()

    def finished(all_done: Future[list[Future[Any]]]) -> None:
        for fut in all_done.value():
            try:
                fut.wait()
            except Exception as exc:  # noqa: BLE001 - one worker's failure must not stop the others
                logger.warning("releasing autograd context %d failed on a worker: %s", context_id, exc)
        done.set_result(None)

    _release_on_workers(state, released).add_done_callback(finished)
    return done


def running_backward() -> int | None:
    """The id of the context whose distributed backward pass runs on this thread, or None.

    True inside the autograd hooks of a pass of :func:`backward` on this
    worker (the first, or one that gradients arriving by RPC start). Such a
    pass computes gradients for the context, not into ``.grad``, and the
    hooks of ``AccumulateGrad`` nodes do not run: a module that reduces
    gradients during backward (ddp_join's ``DistributedDataParallel``)
    asks this to reduce the context's gradients instead. Hooks on CPU
    tensors run on this thread; hooks on accelerator tensors may not.
    """
    context_id: int | None = getattr(_running, "context_id", None)
    return context_id


def _check_context_id(context_id: object) -> int:
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError(
            f"incompatible function arguments: context_id={context_id!r} must be an int, "
            "the id that dist_autograd.context() yields"
        )
    return context_id


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients of this worker's leaf tensors accumulated in context ``context_id``."""
    context = api._current().grad.get(_check_context_id(context_id))
    with context.lock:
        return dict(context.grads)


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass of ``roots`` (scalars) across every worker of context ``context_id``.

    Gradients of leaves are accumulated in the context on the worker that
    holds them (:func:`get_gradients`). ``retain_graph`` is accepted for
    torch's signature; graphs are kept until the context ends, so backward
    may run more than once in one context. An error on another worker is
    raised here, with that worker's traceback in its notes.

    A hook on a leaf tensor (``Tensor.register_hook``) sees the leaf's
    gradient in each pass and may return a replacement. The context keeps
    that replacement itself, not a copy, when it is the leaf's first
    gradient in the context and a fresh dense tensor with the leaf's
    strides: the hook's owner may still update it in place until this
    returns (see :func:`running_backward`).
    """
    del retain_graph  # graphs live until the context ends (see the docstring)
    state = api._current()
    context = state.grad.get(_check_context_id(context_id))
    if not isinstance(roots, (list, tuple)):
        raise TypeError(f"incompatible function arguments: roots={roots!r} must be a list of tensors")
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation: roots=[]; pass the loss")
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"incompatible function arguments: roots holds {root!r}, not a tensor")
        if not root.requires_grad:
            raise RuntimeError(f"requires_grad not set on root {root!r}: it does not depend on any parameter")
        if root.numel() != 1:
            raise RuntimeError(
                f"Tensor of shape {tuple(root.shape)} is not a scalar, all roots need to be scalar; "
                "reduce it, e.g. with .sum()"
            )
        if root.grad_fn is None:
            raise RuntimeError(
                f"root {root!r} does not have a valid gradient function: it is a leaf, so there is "
                "nothing to differentiate"
            )
    _run_pass(state, context, list(roots), [torch.ones_like(root) for root in roots]).wait()


def _leaves(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors whose gradient ``outputs`` reach (their accumulate-grad nodes)."""
    seen: set[Any] = set()
    leaves: list[torch.Tensor] = []
    stack: list[Any] = [out.grad_fn for out in outputs if out.grad_fn is not None]
    while stack:
        node: Any = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return leaves


def _buffer(grad: torch.Tensor) -> int:
    """The address of the memory holding ``grad``'s values (its values', for a sparse COO tensor)."""
    values = grad._values() if grad.layout == torch.sparse_coo else grad
    return int(values.untyped_storage().data_ptr())


def _stealable(leaf: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the context may keep ``grad`` without a copy (as torch's engine does).

    It may when the layout is the leaf's own: dense and contiguous with the
    leaf's strides, or sparse COO with contiguous indices and values; and
    (checked by the caller) no other gradient of the pass shares its memory.
    """
    if grad.requires_grad:
        return False
    if grad.layout == torch.strided:
        return leaf.layout == torch.strided and grad.is_contiguous() and grad.stride() == leaf.stride()
    if grad.layout == torch.sparse_coo:
        return bool(grad._indices().is_contiguous() and grad._values().is_contiguous())
    return False


def _run_pass(
    state: api._RpcState, context: GradContext, outputs: list[torch.Tensor], grads: list[torch.Tensor]
) -> Future[None]:
    """Backpropagate ``grads`` from ``outputs`` here, then to the senders of recv leaves reached."""
    me = state.me
    reached: list[tuple[torch.Tensor, torch.Tensor]] = []
    inner: list[tuple[torch.Tensor, torch.Tensor]] = []
    for out, grad in zip(outputs, grads):
        if out.requires_grad:
            # A leaf goes through a view of itself, so that its hooks see the gradient.
            inner.append((out if out.grad_fn is not None else out.view_as(out), grad))
    if inner:
        leaves = _leaves([out for out, _ in inner])
        if leaves:
            outer, _running.context_id = getattr(_running, "context_id", None), context.context_id
            try:
                found: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
                    [out for out, _ in inner],
                    leaves,
                    [grad for _, grad in inner],
                    retain_graph=True,
                    allow_unused=True,
                )
            except Exception as exc:
                raise RuntimeError(f"Error on Node {me.id}: {exc} (on {me.name})") from exc
            finally:
                _running.context_id = outer
            reached.extend((leaf, grad) for leaf, grad in zip(leaves, found) if grad is not None)
    to_senders: dict[tuple[str, int], tuple[WorkerInfo, dict[int, torch.Tensor]]] = {}
    buffers = collections.Counter(_buffer(grad) for _, grad in reached)
    for leaf, grad in reached:
        with context.lock:
            recv = context.recvs.get(id(leaf))
        if recv is None or recv[0] is not leaf:
            context.accumulate(leaf, grad, steal=_stealable(leaf, grad) and buffers[_buffer(grad)] == 1)
            continue
        info = recv[1]
        _, by_index = to_senders.setdefault((info.sender.name, info.send_id), (info.sender, {}))
        known = by_index.get(info.index)
        by_index[info.index] = grad if known is None else known + grad
    if not to_senders:
        return completed(None)
    timeout = state.resolve_timeout(-1)
    futures = [
        state.request(
            sender, ("call", _backward_from_send, (context.context_id, send_id, by_index), {}), timeout, False
        )
        for (_, send_id), (sender, by_index) in to_senders.items()
    ]
    done: Future[None] = Future()

    def finished(all_done: Future[list[Future[Any]]]) -> None:
        try:
            for fut in all_done.value():
                fut.wait()
        except Exception as exc:  # noqa: BLE001 - the first failure reaches the caller
            fail(done, exc)
        else:
            done.set_result(None)

    torch.futures.collect_all(futures).add_done_callback(finished)
    return done


@async_execution
def _backward_from_send(context_id: int, send_id: int, grads: dict[int, torch.Tensor]) -> Future[None]:
    """Continue backward on the worker that sent tensors: ``grads`` by their position in the send."""
    state = api._current()
    context = state.grad.get(context_id)
    with context.lock:
        sent = context.sends.get(send_id)
    if sent is None:
        raise RuntimeError(f"autograd context {context_id} on {state.me.name} has no send {send_id}")
    return _run_pass(state, context, [sent[i] for i in grads], list(grads.values()))
