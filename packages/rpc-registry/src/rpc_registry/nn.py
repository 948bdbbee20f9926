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

from typing import Any, NoReturn

import torch
from torch import nn
from torch.futures import Future
from typing_extensions import Self

from .api import get_worker_info, rpc_async, rpc_sync
from .engine import _current
from .errors import ModuleClassError
from .pickling import pickling_for_rpc
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


# Methods of nn.Module that would act on this local proxy, not the remote module: as torch's
# RemoteModule, they raise ValueError.
_UNSUPPORTED: tuple[str, ...] = (
    "register_buffer",
    "register_parameter",
    "add_module",
    "apply",
    "cuda",
    "ipu",
    "xpu",
    "cpu",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "register_backward_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_forward_pre_hook",
    "register_forward_hook",
    "state_dict",
    "load_state_dict",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
    "extra_repr",
)
# What RPC sends of a RemoteModule (as torch's: attributes set later stay behind).
_PICKLED: tuple[str, ...] = ("on", "device", "module_rref", "training")


def _not_a_module(what: str) -> ModuleClassError:
    # torch's phrase first, which callers may match.
    return ModuleClassError(
        f"Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, but {what}; "
        "pass a subclass of torch.nn.Module"
    )


def _create_module(
    module_cls: type[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> RRef[nn.Module]:
    module: object = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise _not_a_module(f"it returns an instance of {type(module)}")
    return RRef(module.to(device))


def _set_training(module: RRef[nn.Module], mode: bool) -> None:
    module.local_value().train(mode)


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
            raise _not_a_module(f"module_cls={module_cls!r} is not a subclass of torch.nn.Module")
        self.on: WorkerInfo = (
            get_worker_info(worker) if isinstance(worker, str) else _worker_by_rank(worker, remote_device)
        )
        self.device: str = str(device)
        self.module_rref: RRef[nn.Module] = rpc_sync(
            self.on, _create_module, args=(module_cls, tuple(args or ()), dict(kwargs or {}), self.device)
        )

    @staticmethod
    def init_from_module_rref(
        remote_device: str, module_rref: RRef[nn.Module], _module_interface_cls: Any = None
    ) -> RemoteModule:
        """A RemoteModule for the module that ``module_rref`` holds, which its owner created.

        Several RemoteModules (on any workers) may so share one remote module.
        Calls go to the owner of ``module_rref``; ``remote_device`` sets
        :attr:`on` and :attr:`device`, as torch's (which does not check them).
        ``_module_interface_cls`` (TorchScript) must be None.

        Example::

            first = RemoteModule("worker1/cpu", torch.nn.Linear, args=(4, 2))
            second = RemoteModule.init_from_module_rref("worker1/cpu", first.get_module_rref())
        """
        if _module_interface_cls is not None:
            raise ValueError(
                f"_module_interface_cls={_module_interface_cls!r}: TorchScript RemoteModules are not "
                "supported; leave it None"
            )
        if not isinstance(module_rref, RRef):
            raise TypeError(f"module_rref={module_rref!r}: must be the RRef of an nn.Module")
        worker, device = _parse_remote_device(remote_device)
        on = get_worker_info(worker) if isinstance(worker, str) else _worker_by_rank(worker, remote_device)
        remote_module = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(remote_module)
        remote_module.on = on
        remote_module.device = str(device)
        remote_module.module_rref = module_rref
        return remote_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The remote module's forward on ``args`` (run on its worker)."""
        return rpc_sync(self.module_rref.owner(), _forward, args=(self.module_rref, args, kwargs))

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Like :meth:`forward`; the future holds the result."""
        return rpc_async(self.module_rref.owner(), _forward, args=(self.module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """RRefs to the remote module's parameters (e.g. for ``DistributedOptimizer``)."""
        return rpc_sync(self.module_rref.owner(), _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> RRef[nn.Module]:
        """The RRef of the module itself, owned by its worker."""
        return self.module_rref

    def train(self, mode: bool = True) -> Self:
        """Set the remote module's training mode (``module.train(mode)`` on its worker)."""
        rpc_sync(self.module_rref.owner(), _set_training, args=(self.module_rref, mode))
        self.training = mode
        return self

    def eval(self) -> Self:
        """Put the remote module in evaluation mode (``module.eval()`` on its worker)."""
        return self.train(False)

    def parameters(self, recurse: bool = True) -> NoReturn:
        """Not supported, as torch's: the parameters are remote; see :meth:`remote_parameters`."""
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use ``remote_parameters`` instead."
        )

    def __getstate__(self) -> dict[str, Any]:
        """Only RPC may pickle a RemoteModule: it arrives as one for the same remote module,
        without attributes set after it was made (as torch's)."""
        if not pickling_for_rpc():
            raise RuntimeError(
                "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
            )
        return {name: self.__dict__[name] for name in _PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__init__(self)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on.name!r}, device={self.device!r}, module_rref={self.module_rref!r})"


def _unsupported(name: str) -> Any:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule")

    method.__name__ = name
    method.__doc__ = f"Not supported, as torch's: ``{name}`` would act on this local proxy."
    return method


for _name in _UNSUPPORTED:
    setattr(RemoteModule, _name, _unsupported(_name))


def _is_module_class(module_cls: object) -> bool:
    return isinstance(module_cls, type) and issubclass(module_cls, nn.Module)


def _worker_by_rank(rank: int, remote_device: str) -> WorkerInfo:
    try:
        return _current().worker(rank)
    except ValueError as exc:
        raise ValueError(f"remote_device={remote_device!r}: no worker has rank {rank}") from exc
