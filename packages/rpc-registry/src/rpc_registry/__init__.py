"""rpc-registry: the backend registry and the backend-agnostic RPC API.

Users call :func:`init_rpc`, :func:`rpc_sync`, :func:`remote` and friends;
backends (installed separately, e.g. ``pip install tensorpipe-backend``)
implement :mod:`rpc_registry.protocols` and announce themselves through the
entry-point group ``rpc_registry.backends`` or :func:`register_backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.distributed_c10d import Store

from . import api, constants, functions
from . import autograd as dist_autograd
from . import registry as backend_registry
from .api import (
    AllGatherStates,
    enable_gil_profiling,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    method_factory,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    ENTRY_POINT_GROUP,
    UNSET_RPC_TIMEOUT,
)
from .errors import ModuleClassError, OperatorSchemaError, WorkerNameError, WorkerRefTypeError
from .exports import backend_export
from .protocols import (
    BackendPlugin,
    ConstructRpcBackendOptionsHandler,
    InitBackendHandler,
    Message,
    RequestHandler,
    RpcAgent,
    RpcBackendOptions,
    WorkerInfo,
)
from .registry import (
    BackendRegistry,
    BackendType,
    BackendValue,
    backend_registered,
    construct_rpc_backend_options,
    init_backend,
    register_backend,
)
from .rref import RRef
from .slow_calls import DEFAULT_SLOW_CALL_THRESHOLD, report_slow_calls

if TYPE_CHECKING:
    # For type checkers and editors only: at run time these names come from
    # whichever installed backend declares them (see __getattr__), so
    # importing rpc_registry loads no backend. Without tensorpipe-backend
    # installed a checker sees them as unknown, and run time raises
    # AttributeError with the install hint.
    from tensorpipe_backend import TensorPipeAgent as TensorPipeAgent
    from tensorpipe_backend import TensorPipeRpcBackendOptions as TensorPipeRpcBackendOptions

PyRRef = RRef
"""torch's other name of :class:`RRef`."""


def __getattr__(name: str) -> object:
    # Names of torch.distributed.rpc that a backend provides (TensorPipeRpcBackendOptions, ...).
    found = None if name.startswith("__") else backend_export(name)
    if found is None:
        hint = (
            "; no installed backend provides it (pip install tensorpipe-backend for the TENSORPIPE names)"
            if name.endswith(("RpcBackendOptions", "Agent"))
            else ""
        )
        raise AttributeError(f"module 'rpc_registry' has no attribute {name!r}{hint}")
    return found


__version__ = "0.2.0"
"""This distribution's version (see CHANGELOG.md)."""

__all__ = [
    "DEFAULT_SLOW_CALL_THRESHOLD",
    "AllGatherStates",
    "PyRRef",
    "Store",
    "api",
    "backend_registry",
    "constants",
    "dist_autograd",
    "enable_gil_profiling",
    "get_rpc_timeout",
    "is_available",
    "method_factory",
    "DEFAULT_INIT_METHOD",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "UNSET_RPC_TIMEOUT",
    "BackendPlugin",
    "BackendRegistry",
    "BackendType",
    "BackendValue",
    "ConstructRpcBackendOptionsHandler",
    "InitBackendHandler",
    "Message",
    "ModuleClassError",
    "OperatorSchemaError",
    "RRef",
    "RequestHandler",
    "RpcAgent",
    "RpcBackendOptions",
    "WorkerInfo",
    "WorkerNameError",
    "WorkerRefTypeError",
    "backend_registered",
    "construct_rpc_backend_options",
    "functions",
    "get_worker_info",
    "init_backend",
    "init_rpc",
    "register_backend",
    "remote",
    "report_slow_calls",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
