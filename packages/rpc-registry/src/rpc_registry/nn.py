"""``RemoteModule``: an ``nn.Module`` built on another worker and called there by RPC.

The counterpart of ``torch.distributed.nn.RemoteModule``. Calls made inside a
:mod:`rpc_registry.autograd` context take part in distributed backward, and
:meth:`RemoteModule.remote_parameters` gives the RRefs a
:class:`~rpc_registry.optim.DistributedOptimizer` steps.

Example::

    layer = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
    out = layer(torch.ones(3, 4))  # runs on worker1
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.futures import Future

from .api import _current, get_worker_info, rpc_async, rpc_sync
from .protocols import WorkerInfo
from .rref import RRef

__all__ = ["RemoteModule"]


def _parse_remote_device(remote_device: str) -> tuple[str | int, torch.device]:
    """``"worker1/cuda:0"``, ``"rank:1/cpu"`` or ``"worker1"`` as (worker, device)."""
    if not isinstance(remote_device, str):
        raise TypeError(f"remote_device={remote_device!r}: must be a str such as 'worker1/cpu'")
    worker, _, device = remote_device.partition("/")
    if not worker or (_ and not device):
        raise ValueError(
            f"remote_device={remote_device!r}: expected '<worker name>/<device>', "
            "'rank:<rank>/<device>' or '<worker name>', e.g. 'worker1/cpu'"
        )
    try:
        parsed_device = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise ValueError(f"remote_device={remote_device!r}: {device!r} is not a device ({exc})") from exc
    if worker.startswith("rank:"):
        rank = worker[len("rank:") :]
        if not rank.isdigit():
            raise ValueError(f"remote_device={remote_device!r}: the rank after 'rank:' must be an int")
        return int(rank), parsed_device
    return worker, parsed_device


def _create_module(
    module_cls: type[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> RRef[nn.Module]:
    return RRef(module_cls(*args, **kwargs).to(device))


def _forward(module: RRef[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return module.local_value()(*args, **kwargs)


def _param_rrefs(module: RRef[nn.Module], recurse: bool) -> list[RRef[nn.Parameter]]:
    return [RRef(param) for param in module.local_value().parameters(recurse)]


class RemoteModule(nn.Module):
    """``module_cls(*args, **kwargs)`` built on ``remote_device`` and called there.

    ``remote_device`` is ``"<worker name>/<device>"`` (or ``"rank:<rank>/<device>"``);
    the module is moved to that device on its worker. Calling this object
    (or :meth:`forward`) runs the remote module's forward by ``rpc_sync``;
    :meth:`forward_async` by ``rpc_async``.
    """

    def __init__(
        self,
        remote_device: str,
        module_cls: type[nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        worker, device = _parse_remote_device(remote_device)
        if not _is_module_class(module_cls):
            raise TypeError(f"module_cls={module_cls!r}: must be a subclass of torch.nn.Module")
        self.on: WorkerInfo = (
            get_worker_info(worker) if isinstance(worker, str) else _worker_by_rank(worker, remote_device)
        )
        self.device: str = str(device)
        self.module_rref: RRef[nn.Module] = rpc_sync(
            self.on, _create_module, args=(module_cls, tuple(args or ()), dict(kwargs or {}), self.device)
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The remote module's forward on ``args`` (run on its worker)."""
        return rpc_sync(self.on, _forward, args=(self.module_rref, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Like :meth:`forward`; the future holds the result."""
        return rpc_async(self.on, _forward, args=(self.module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """RRefs to the remote module's parameters (e.g. for ``DistributedOptimizer``)."""
        return rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> RRef[nn.Module]:
        """The RRef of the module itself, owned by its worker."""
        return self.module_rref


def _is_module_class(module_cls: object) -> bool:
    return isinstance(module_cls, type) and issubclass(module_cls, nn.Module)


def _worker_by_rank(rank: int, remote_device: str) -> WorkerInfo:
    try:
        return _current().worker(rank)
    except ValueError as exc:
        raise ValueError(f"remote_device={remote_device!r}: no worker has rank {rank}") from exc
