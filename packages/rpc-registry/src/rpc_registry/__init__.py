"""rpc-registry: the backend registry and the backend-agnostic RPC API.

Users call :func:`init_rpc`, :func:`rpc_sync`, :func:`remote` and friends;
backends (installed separately, e.g. ``pip install tensorpipe-backend``)
implement :mod:`rpc_registry.protocols` and announce themselves through the
entry-point group ``rpc_registry.backends`` or :func:`register_backend`.
"""

from __future__ import annotations

from . import functions
from .api import get_worker_info, init_rpc, remote, rpc_async, rpc_sync, shutdown
from .constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_RPC_TIMEOUT_SEC,
    DEFAULT_SHUTDOWN_TIMEOUT,
    ENTRY_POINT_GROUP,
    UNSET_RPC_TIMEOUT,
)
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

__all__ = [
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
    "RRef",
    "RequestHandler",
    "RpcAgent",
    "RpcBackendOptions",
    "WorkerInfo",
    "backend_registered",
    "construct_rpc_backend_options",
    "functions",
    "get_worker_info",
    "init_backend",
    "init_rpc",
    "register_backend",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
