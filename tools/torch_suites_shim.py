"""Points torch's RPC names at rpc-registry, for running torch's own test suites against it.

``install()`` replaces the public names of ``torch.distributed.rpc``,
``torch.distributed.autograd``, ``torch.distributed.optim`` and
``torch.distributed.nn`` with ours, and ``torch.nn.parallel``'s
``DistributedDataParallel`` with ddp-join's, in this process only; torch's private
names stay torch's (tests that use them are not counted as applicable, see
``torch_suites.py``). Call it before importing a test module: the modules
bind names at import.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

# torch.distributed.rpc's public names that ours replace one for one.
RPC_NAMES: Final = (
    "AllGatherStates",
    "BackendType",
    "PyRRef",
    "RRef",
    "RpcAgent",
    "RpcBackendOptions",
    "WorkerInfo",
    "backend_registered",
    "construct_rpc_backend_options",
    "enable_gil_profiling",
    "get_rpc_timeout",
    "get_worker_info",
    "init_backend",
    "init_rpc",
    "is_available",
    "method_factory",
    "register_backend",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
)

_installed = False


def install() -> None:
    """Replace torch's public RPC, distributed autograd and optimizer names with ours (once)."""
    global _installed
    if _installed:
        return
    import ddp_join
    import rpc_registry
    import rpc_registry.autograd
    import rpc_registry.nn
    import rpc_registry.optim
    import tensorpipe_backend

    tensorpipe_backend.ensure_registered()
    # Typed as Any: these are torch's modules, given attributes they do not declare.
    torch_rpc: Any = importlib.import_module("torch.distributed.rpc")
    for name in RPC_NAMES:
        setattr(torch_rpc, name, getattr(rpc_registry, name))
    torch_rpc.TensorPipeRpcBackendOptions = tensorpipe_backend.TensorPipeRpcBackendOptions
    torch_rpc.TensorPipeAgent = tensorpipe_backend.TensorPipeAgent
    registry: Any = importlib.import_module("torch.distributed.rpc.backend_registry")
    for name in ("BackendType", "backend_registered", "construct_rpc_backend_options", "init_backend"):
        setattr(registry, name, getattr(rpc_registry, name))
    registry.register_backend = rpc_registry.register_backend
    api: Any = importlib.import_module("torch.distributed.rpc.api")
    for name in ("init_rpc", "rpc_sync", "rpc_async", "remote", "shutdown", "get_worker_info", "RRef"):
        if hasattr(api, name):
            setattr(api, name, getattr(rpc_registry, name))
    functions: Any = importlib.import_module("torch.distributed.rpc.functions")
    functions.async_execution = rpc_registry.functions.async_execution
    autograd: Any = importlib.import_module("torch.distributed.autograd")
    for name in ("context", "backward", "get_gradients", "is_available"):
        setattr(autograd, name, getattr(rpc_registry.autograd, name))
    optim: Any = importlib.import_module("torch.distributed.optim")
    optim.DistributedOptimizer = rpc_registry.optim.DistributedOptimizer
    torch_nn: Any = importlib.import_module("torch.distributed.nn")
    torch_nn.RemoteModule = rpc_registry.nn.RemoteModule
    parallel: Any = importlib.import_module("torch.nn.parallel")
    parallel.DistributedDataParallel = ddp_join.DistributedDataParallel
    _installed = True
