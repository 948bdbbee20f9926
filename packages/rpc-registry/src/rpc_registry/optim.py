"""``DistributedOptimizer``: one local optimizer per owner of the parameters, stepped by RPC.

The counterpart of ``torch.distributed.optim.DistributedOptimizer`` for
:mod:`rpc_registry.autograd`: ``step(context_id)`` steps every owner's
optimizer concurrently, each with the gradients that context accumulated on
its worker.

Example::

    with dist_autograd.context() as context_id:
        loss = model(inputs).sum()
        dist_autograd.backward(context_id, [loss])
        dist_optim.step(context_id)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .api import rpc_async
from .autograd import get_gradients
from .protocols import WorkerInfo
from .rref import RRef

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """The optimizer of one owner, over the parameters it holds."""

    # Steps of local optimizers on one worker take turns, as torch's: two
    # DistributedOptimizers may share parameters on this worker.
    _step_lock = threading.Lock()

    def __init__(
        self,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        local_params_rref: list[RRef[torch.Tensor]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._params = [rref.local_value() for rref in local_params_rref]
        self.optim = optimizer_class(self._params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        """Step with the gradients of ``context_id`` on this worker (``.grad`` is set to them)."""
        grads = get_gradients(context_id)
        with self._step_lock:
            for param in self._params:
                param.grad = grads.get(param)
            self.optim.step()


def _new_local_optimizer(
    optimizer_class: Callable[..., torch.optim.Optimizer],
    local_params_rref: list[RRef[torch.Tensor]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> RRef[_LocalOptimizer]:
    return RRef(_LocalOptimizer(optimizer_class, local_params_rref, args, kwargs))


def _local_step(optimizer: RRef[_LocalOptimizer], context_id: int) -> None:
    optimizer.local_value().step(context_id)


class DistributedOptimizer:
    """Steps parameters spread over workers, given as RRefs (e.g. ``RemoteModule.remote_parameters()``).

    ``optimizer_class(params, *args, **kwargs)`` (a class, or any picklable
    callable such as ``functools.partial(torch.optim.SGD, momentum=0.9)``)
    is built on every owner of some of ``params_rref``; :meth:`step`
    applies the gradients of one distributed autograd context on all of
    them concurrently.
    """

    def __init__(
        self,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        params_rref: Sequence[RRef[torch.Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if not callable(optimizer_class):
            raise TypeError(
                f"optimizer_class={optimizer_class!r}: must be an optimizer class such as torch.optim.SGD, "
                "or a callable that builds one from (params, *args, **kwargs)"
            )
        per_owner: dict[str, tuple[WorkerInfo, list[RRef[torch.Tensor]]]] = {}
        for rref in params_rref:
            if not isinstance(rref, RRef):
                raise TypeError(
                    f"params_rref holds {rref!r}: every parameter must be an RRef, e.g. "
                    "RRef(param) on its owner or RemoteModule.remote_parameters()"
                )
            per_owner.setdefault(rref.owner_name(), (rref.owner(), []))[1].append(rref)
        futures = [
            rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in per_owner.values()
        ]
        self.remote_optimizers: list[RRef[_LocalOptimizer]] = [fut.wait() for fut in futures]

    def step(self, context_id: int) -> None:
        """One step of every owner's optimizer with the gradients of ``context_id``.

        All owners step concurrently; the first error is raised after every
        owner has finished.
        """
        futures = [
            rpc_async(optimizer.owner(), _local_step, args=(optimizer, context_id))
            for optimizer in self.remote_optimizers
        ]
        errors: list[BaseException] = []
        for fut in futures:
            try:
                fut.wait()
            except Exception as exc:  # noqa: BLE001 - raised below, once all owners finished
                errors.append(exc)
        if errors:
            raise errors[0]
