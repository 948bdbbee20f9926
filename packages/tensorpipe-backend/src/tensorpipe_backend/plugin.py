"""The ``rpc_registry.backends`` entry point: the TENSORPIPE backend's two handlers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from torch.distributed.distributed_c10d import Store

from rpc_registry import (
    BackendType,
    ConstructRpcBackendOptionsHandler,
    InitBackendHandler,
    RpcBackendOptions,
    backend_registered,
    register_backend,
)

from .agent import TensorPipeAgent
from .options import TensorPipeRpcBackendOptions, construct_rpc_backend_options_handler

__all__ = ["BACKEND_NAME", "PLUGIN", "TensorPipePlugin", "ensure_registered", "init_backend_handler"]

BACKEND_NAME: Final = "TENSORPIPE"
"""The name under which this backend is registered."""


def init_backend_handler(
    store: Store,
    name: str,
    rank: int,
    world_size: int | None,
    rpc_backend_options: RpcBackendOptions,
) -> TensorPipeAgent:
    """The backend's init handler: a started-up :class:`TensorPipeAgent` for worker ``name``."""
    if not isinstance(rpc_backend_options, TensorPipeRpcBackendOptions):
        # torch's phrase first, which callers may match.
        raise TypeError(
            "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions` for the TENSORPIPE backend: "
            f"rpc_backend_options={rpc_backend_options!r}; build them with TensorPipeRpcBackendOptions(...)"
        )
    return TensorPipeAgent(store, name, rank, world_size, rpc_backend_options)


@dataclass(frozen=True)
class TensorPipePlugin:
    """What the entry point gives ``rpc_registry``: a name and two handlers."""

    name: str
    construct_rpc_backend_options_handler: ConstructRpcBackendOptionsHandler
    init_backend_handler: InitBackendHandler


PLUGIN: Final = TensorPipePlugin(BACKEND_NAME, construct_rpc_backend_options_handler, init_backend_handler)
"""The plugin named by ``TENSORPIPE = "tensorpipe_backend.plugin:PLUGIN"`` in the entry-point group."""


def ensure_registered() -> BackendType:
    """``BackendType.TENSORPIPE``, registering it here when it was not installed as a distribution.

    An installed ``tensorpipe-backend`` is found through its entry point; a
    source checkout on ``sys.path`` is not, and this registers it.
    """
    if not backend_registered(BACKEND_NAME):
        register_backend(BACKEND_NAME, construct_rpc_backend_options_handler, init_backend_handler)
    return BackendType[BACKEND_NAME]
