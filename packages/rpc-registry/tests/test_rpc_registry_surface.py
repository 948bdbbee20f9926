"""torch.distributed.rpc's public names, reachable from rpc_registry (no RPC group needed)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed.autograd as torch_dist_autograd
import torch.distributed.rpc as torch_rpc
from rpcreg_socket_agent import SocketAgent, SocketOptions, socket_backend

import rpc_registry
import rpc_registry.autograd as dist_autograd

# torch.distributed.rpc's module-level imports and what this package leaves out on purpose
# (listed with reasons in the README).
_NOT_API = {
    "Generator",
    "dist",
    "logger",
    "logging",
    "numbers",
    "os",
    "threading",
    "timedelta",
    "torch",
    "urlparse",
    "warnings",
}
_LEFT_OUT = {"RemoteProfilerManager", "server_process_global_profiler", "internal", "options", "new_method"}


def test_every_public_name_of_torch_rpc_is_reachable() -> None:
    socket_backend()
    public = {name for name in dir(torch_rpc) if not name.startswith("_")} | set(torch_rpc.__all__)
    public -= {"TensorPipeRpcBackendOptions", "TensorPipeAgent"}  # provided by a backend: see below
    missing = sorted(name for name in public - _NOT_API - _LEFT_OUT if not hasattr(rpc_registry, name))
    assert missing == []


def test_every_public_name_of_torch_dist_autograd_is_reachable() -> None:
    public = {name for name in dir(torch_dist_autograd) if not name.startswith("_")}
    imports = {"Any", "TYPE_CHECKING", "annotations", "torch"}  # torch's module-level imports
    assert sorted(name for name in public - imports if not hasattr(dist_autograd, name)) == []
    assert set(dist_autograd.__all__) >= public - imports


def _parameters(fn: object) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.parametrize("module", [torch_rpc, torch_dist_autograd], ids=["rpc", "autograd"])
def test_every_python_function_takes_torchs_parameters(module: object) -> None:
    ours = rpc_registry if module is torch_rpc else dist_autograd
    functions = [name for name in dir(module) if inspect.isfunction(getattr(module, name))]
    differ = {
        name: (_parameters(getattr(module, name)), _parameters(getattr(ours, name)))
        for name in functions
        if not name.startswith("_") and name not in _NOT_API | _LEFT_OUT
        if _parameters(getattr(module, name)) != _parameters(getattr(ours, name))
    }
    assert differ == {}


def test_a_backends_options_and_agent_classes_are_reexported_lazily() -> None:
    socket_backend()
    assert rpc_registry.SocketOptions is SocketOptions
    assert rpc_registry.SocketAgent is SocketAgent


def test_unknown_backend_name_says_which_package_provides_it() -> None:
    with pytest.raises(AttributeError, match="no installed backend provides it"):
        rpc_registry.NoSuchRpcBackendOptions  # noqa: B018 - the access is the test


def test_availability_and_torch_aliases() -> None:
    assert rpc_registry.is_available() and dist_autograd.is_available()
    assert rpc_registry.PyRRef is rpc_registry.RRef
    assert rpc_registry.dist_autograd is dist_autograd
    assert rpc_registry.backend_registry.register_backend is rpc_registry.register_backend
    assert rpc_registry.functions.async_execution is not None


def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")  # torch 2.14
def test_torchscript_target_gets_a_clear_error() -> None:
    scripted = torch.jit.script(_twice)
    for call in (rpc_registry.rpc_sync, rpc_registry.rpc_async, rpc_registry.remote):
        with pytest.raises(TypeError, match="TorchScript functions are not supported as RPC targets"):
            call("w1", scripted, args=(torch.ones(1),))


def test_gil_profiling_is_refused_when_enabled() -> None:
    rpc_registry.enable_gil_profiling(False)
    with pytest.raises(NotImplementedError, match="does not measure GIL wait times"):
        rpc_registry.enable_gil_profiling(True)


def test_method_factory_calls_the_rref_method() -> None:
    method = rpc_registry.method_factory("owner_name", "the owner's name")
    assert method.__doc__ == "the owner's name"
    assert method.__name__ == "owner_name"


@pytest.mark.parametrize(
    "name,message",
    [
        ("abc*", "Worker name must match"),
        (" ", "Worker name must match"),
        ("", "must be non-empty"),
        ("a" * 500, "shorter than 128"),
    ],
)
def test_worker_info_rejects_names_torch_rejects(name: str, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        rpc_registry.WorkerInfo(name, 0)
