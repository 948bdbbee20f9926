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
import functools
import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, TypeAlias

import torch
from torch.futures import Future
from torch.utils.hooks import RemovableHandle

from . import engine
from .functions import async_execution
from .grad_contexts import GradContext
from .protocols import WorkerInfo
from .rref import completed, fail

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["DistAutogradContext", "backward", "context", "get_gradients", "is_available", "running_backward"]

DistAutogradContext = GradContext
"""torch's name of the type of one distributed autograd context on one worker
(:class:`~rpc_registry.grad_contexts.GradContext`)."""

# Gradients as torch's engine hands them to a node's hooks (None: no gradient).
GradTuple: TypeAlias = tuple[torch.Tensor | None, ...]

# The context whose backward pass this thread runs, while it runs it.
_running = threading.local()

# What ``Node.name()`` says of a leaf's accumulate-grad node (a custom Function's node is named
# after its class, which cannot hold "::").
_ACCUMULATE_GRAD: Final = "torch::autograd::AccumulateGrad"


def is_available() -> bool:
    """Distributed autograd is always available (it needs no compiled extension)."""
    return True


class context:
    """A distributed autograd context; ``with`` yields its id.

    Calls made in the ``with`` body (on this thread) record their tensors for
    :func:`backward`. On exit the context is released here, and the workers
    it reached are asked to release it too, without waiting for them (as in
    torch; a failure is logged).
    """

    def __init__(self) -> None:
        self._context_id: int | None = None

    def __enter__(self) -> int:
        state = engine._current()
        self._context_id = state.grad.new_context().context_id
        return self._context_id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        context_id, self._context_id = self._context_id, None
        state = engine._state
        if state is None or context_id is None:
            return  # RPC shut down inside the body: its contexts are gone with it
        state.grad.clear_current()
        released = state.grad.release(context_id)
        if released is not None:
            _release_on_workers(state, released)


def _release_on_workers(state: engine._RpcState, released: GradContext) -> None:
    """Ask the other workers that ``released`` reached to release it; failures are logged, not waited for.

    Exit never waits on a slow or lost worker, as in torch.
    """
    timeout = state.resolve_timeout(-1)
    for worker in released.workers.values():
        if worker.name == state.me.name:
            continue
        try:
            fut = state.request(
                worker, ("call", _release_here, (released.context_id,), {}), timeout, in_context=False
            )
        except Exception as exc:  # noqa: BLE001 - logged: the context ends here all the same
            _log_failed_release(released.context_id, worker.name, exc)
        else:
            fut.add_done_callback(functools.partial(_check_release, released.context_id, worker.name))


def _check_release(context_id: int, worker_name: str, fut: Future[Any]) -> None:
    try:
        fut.wait()
    except Exception as exc:  # noqa: BLE001 - a callback has no caller to raise to
        _log_failed_release(context_id, worker_name, exc)


def _log_failed_release(context_id: int, worker_name: str, exc: Exception) -> None:
    logger.warning("releasing autograd context %d on %s failed: %s", context_id, worker_name, exc)


def _release_here(context_id: int) -> None:
    """Release ``context_id`` on this worker, then on the workers it reached from here."""
    state = engine._current()
    released = state.grad.release(context_id)
    if released is not None:
        _release_on_workers(state, released)


def running_backward() -> int | None:
    """The id of the context whose distributed backward pass runs on this thread, or None.

    True inside the autograd hooks of a pass of :func:`backward` on this
    worker (the first, or one that gradients arriving by RPC start). Such a
    pass computes gradients for the context, not into ``.grad``, so hooks
    that follow accumulation into ``.grad``
    (``Tensor.register_post_accumulate_grad_hook``) do not run, as in
    torch: a module that reduces gradients during backward (ddp_join's
    ``DistributedDataParallel``) asks this to reduce the context's
    gradients instead. Hooks on CPU tensors run on this thread; hooks on
    accelerator tensors may not. The hooks of a leaf's ``AccumulateGrad``
    node run on this thread (see :func:`backward`).
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
    context = engine._current().grad.get(_check_context_id(context_id))
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

    Hooks on a leaf's ``AccumulateGrad`` node (for example
    ``(leaf * 2).grad_fn.next_functions[0][0]``) run as torch's distributed engine
    runs them, once per pass that reaches the leaf, the node itself never
    running: its pre hooks (``register_prehook``) get ``(gradient,)`` and
    may return a replacement, which the context keeps as a copy; its post
    hooks (``register_hook``) then get ``((), (gradient,))``. Hooks
    registered from C++ on such a node do not run.
    """
    del retain_graph  # graphs live until the context ends (see the docstring)
    state = engine._current()
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


def _leaves(outputs: list[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
    """The leaf tensors whose gradient ``outputs`` reach, each with its accumulate-grad node."""
    seen: set[Any] = set()
    leaves: list[tuple[torch.Tensor, Any]] = []
    stack: list[Any] = [out.grad_fn for out in outputs if out.grad_fn is not None]
    while stack:
        node: Any = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.name() == _ACCUMULATE_GRAD:
            leaves.append((node.variable, node))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return leaves


_probe_lock = threading.Lock()


def _probe(*args: object) -> None:
    """A hook that does nothing: registered only to find a node's other hooks."""


def _hooks_of(register: Callable[[Callable[..., None]], RemovableHandle]) -> list[Callable[..., Any]]:
    """The Python hooks that a node's ``register_hook`` or ``register_prehook`` holds, in calling order.

    A node keeps the Python hooks of each kind in one dict, indexed by hook
    id, which every handle it returns refers to: a probe registered and
    removed at once reads it. Hooks added from C++ are not in it.
    """
    # Passes of other contexts may read the same node's hooks (a parameter that trainers
    # share): one at a time, so that none iterates the dict while another's probe is added.
    with _probe_lock:
        handle = register(_probe)
        try:
            hooks = handle.hooks_dict_ref()
            return [hook for key, hook in hooks.items() if key != handle.id] if hooks is not None else []
        finally:
            handle.remove()


def _checked(hook: Callable[..., Any], previous: GradTuple, result: object) -> GradTuple:
    """``result`` of a node hook that replaces ``previous``, refused as torch's engine refuses it."""
    name = getattr(hook, "__name__", repr(hook))
    if not isinstance(result, tuple):
        raise TypeError(
            f"expected tuple, but hook returned '{type(result).__name__}': hook {name!r} must return "
            "a tuple of tensors (or None to keep the gradients)"
        )
    if len(result) != len(previous):
        raise RuntimeError(
            f"hook '{name}' has returned an incorrect number of values (got {len(result)}, but expected "
            f"{len(previous)})"
        )
    for old, new in zip(previous, result):
        if new is None:
            continue
        if not isinstance(new, torch.Tensor):
            raise TypeError(
                f"expected Variable, but hook returned '{type(new).__name__}': hook {name!r} "
                "must return tensors or None"
            )
        if old is None:
            raise RuntimeError(f"can't replace a None gradient with a non-None value (hook '{name}')")
        if new.type() != old.type():
            raise RuntimeError(
                f"hook '{name}' has changed the type of value (was {old.type()} got {new.type()})"
            )
        if new.device != old.device:
            raise RuntimeError(
                f"hook '{name}' has changed the device of value (was {old.device} got {new.device})"
            )
        if new.shape != old.shape:
            raise RuntimeError(
                f"hook '{name}' has changed the size of value (was {tuple(old.shape)} got {tuple(new.shape)})"
            )
    return result


def _accumulate_with_node_hooks(
    context: GradContext, leaf: torch.Tensor, node: Any, grad: torch.Tensor | None, steal: bool
) -> None:
    """What torch's distributed engine does at a leaf's accumulate-grad node instead of running it.

    The node's pre hooks see the gradient (``None`` when the pass gave the
    leaf none) and may replace it, the result is accumulated in the
    context, and the node's post hooks are called with ``((), (gradient,))``;
    what they return is checked and otherwise unused.
    """
    pre_hooks, post_hooks = _hooks_of(node.register_prehook), _hooks_of(node.register_hook)
    grads: GradTuple = (grad,)
    for hook in pre_hooks:
        result = hook(grads)
        if result is not None and result is not grads:
            grads = _checked(hook, grads, result)
    (final,) = grads
    if final is not None:
        # A gradient a hook returned may be held by the hook's owner: kept as a copy.
        context.accumulate(leaf, final, steal=steal and final is grad)
    outputs: GradTuple = ()
    for hook in post_hooks:
        result = hook(outputs, grads)
        if result is not None and result is not outputs:
            outputs = _checked(hook, outputs, result)


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


def _accumulate(
    context: GradContext, reached: list[tuple[torch.Tensor, Any, torch.Tensor | None]]
) -> dict[tuple[str, int], tuple[WorkerInfo, dict[int, torch.Tensor]]]:
    """Keep the gradients of this worker's leaves of a pass (``(leaf, its node, gradient)``) in ``context``.

    Returns the gradients of recv leaves, summed by the send entry (sender,
    send id) and position they go back to.
    """
    to_senders: dict[tuple[str, int], tuple[WorkerInfo, dict[int, torch.Tensor]]] = {}
    buffers = collections.Counter(_buffer(grad) for _, _, grad in reached if grad is not None)
    for leaf, node, grad in reached:
        with context.lock:
            recv = context.recvs.get(id(leaf))
        if recv is None or recv[0] is not leaf:
            steal = grad is not None and _stealable(leaf, grad) and buffers[_buffer(grad)] == 1
            _accumulate_with_node_hooks(context, leaf, node, grad, steal)
            continue
        if grad is None:
            continue
        info = recv[1]
        _, by_index = to_senders.setdefault((info.sender.name, info.send_id), (info.sender, {}))
        known = by_index.get(info.index)
        by_index[info.index] = grad if known is None else known + grad
    return to_senders


def _run_pass(
    state: engine._RpcState, context: GradContext, outputs: list[torch.Tensor], grads: list[torch.Tensor]
) -> Future[None]:
    """Backpropagate ``grads`` from ``outputs`` here, then to the senders of recv leaves reached."""
    me = state.me
    to_senders: dict[tuple[str, int], tuple[WorkerInfo, dict[int, torch.Tensor]]] = {}
    inner: list[tuple[torch.Tensor, torch.Tensor]] = []
    for out, grad in zip(outputs, grads):
        if out.requires_grad:
            # A leaf goes through a view of itself, so that its hooks see the gradient.
            inner.append((out if out.grad_fn is not None else out.view_as(out), grad))
    if inner:
        nodes = _leaves([out for out, _ in inner])
        if nodes:
            outer, _running.context_id = getattr(_running, "context_id", None), context.context_id
            try:
                found: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
                    [out for out, _ in inner],
                    [leaf for leaf, _ in nodes],
                    [grad for _, grad in inner],
                    retain_graph=True,
                    allow_unused=True,
                )
                to_senders = _accumulate(
                    context, [(leaf, node, grad) for (leaf, node), grad in zip(nodes, found)]
                )
            except Exception as exc:
                raise RuntimeError(f"Error on Node {me.id}: {exc} (on {me.name})") from exc
            finally:
                _running.context_id = outer
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
    state = engine._current()
    context = state.grad.get(context_id)
    with context.lock:
        sent = context.sends.get(send_id)
    if sent is None:
        raise RuntimeError(f"autograd context {context_id} on {state.me.name} has no send {send_id}")
    return _run_pass(state, context, [sent[i] for i in grads], list(grads.values()))
