"""tensorpipe-backend: an RPC agent for rpc-registry, registered as the TENSORPIPE backend.

Python calls and tensors move between workers over authenticated TCP
connections (tensors beside the pickle, straight into preallocated tensors).
A static group publishes its members' records (names, addresses, device
maps) in the rendezvous store of ``rpc_registry.init_rpc``, signed with the
job's secret, and runs its barriers through rank 0 over the agent's own
authenticated connections; a dynamic group keeps its records in the store.
A worker lost without leaving (its process ended, or froze past the
``liveness_timeout``) is named in the errors of the calls to it and leaves
the group; the survivors go on.
Installed, it is ``rpc_registry``'s default backend.
"""

from __future__ import annotations

from .agent import ADDR_ENV, TensorPipeAgent, get_current_agent
from .auth import AuthenticationError
from .device_maps import create_device_list, create_reverse_mapping, validate_device_maps
from .options import (
    DEFAULT_LIVENESS_TIMEOUT,
    DEFAULT_NUM_WORKER_THREADS,
    DeviceType,
    TensorPipeRpcBackendOptions,
    construct_rpc_backend_options_handler,
)
from .plugin import BACKEND_NAME, PLUGIN, ensure_registered, init_backend_handler
from .secret import AUTH_TOKEN_ENV
from .wire import FrameError

__version__ = "0.2.0"
"""This distribution's version (see CHANGELOG.md)."""

__all__ = [
    "ADDR_ENV",
    "AUTH_TOKEN_ENV",
    "BACKEND_NAME",
    "DEFAULT_LIVENESS_TIMEOUT",
    "DEFAULT_NUM_WORKER_THREADS",
    "PLUGIN",
    "AuthenticationError",
    "DeviceType",
    "FrameError",
    "TensorPipeAgent",
    "TensorPipeRpcBackendOptions",
    "construct_rpc_backend_options_handler",
    "create_device_list",
    "create_reverse_mapping",
    "ensure_registered",
    "get_current_agent",
    "init_backend_handler",
    "validate_device_maps",
]
