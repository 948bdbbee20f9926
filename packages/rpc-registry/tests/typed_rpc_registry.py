"""Static types of the public surface, checked by mypy (not run by pytest)."""

from __future__ import annotations

from typing import Any

import torch
from rpcreg_socket_agent import construct_options, init_agent
from torch.futures import Future
from typing_extensions import assert_type

from rpc_registry import (
    BackendType,
    BackendValue,
    RpcBackendOptions,
    RRef,
    WorkerInfo,
    construct_rpc_backend_options,
    get_worker_info,
    register_backend,
    remote,
    rpc_async,
    rpc_sync,
)
from rpc_registry.functions import async_execution


def check_registry() -> None:
    member = register_backend("TYPED", construct_options, init_agent)
    assert_type(member, BackendType)
    assert_type(BackendType.TYPED, BackendType)
    assert_type(BackendType["TYPED"], BackendType)
    assert_type(list(BackendType), list[BackendType])
    assert_type(member.value, BackendValue)
    assert_type(construct_rpc_backend_options(member, devices=["cpu"]), RpcBackendOptions)


def check_api() -> None:
    assert_type(rpc_sync("w1", torch.add, args=(torch.ones(1), 1)), torch.Tensor)
    assert_type(rpc_async("w1", torch.add, args=(torch.ones(1), 1)), Future[torch.Tensor])
    rref = remote("w1", torch.ones, args=([2],))
    assert_type(rref, RRef[torch.Tensor])
    assert_type(rref.to_here(), torch.Tensor)
    assert_type(rref.owner(), WorkerInfo)
    assert_type(get_worker_info(), WorkerInfo)


def scale(x: int, *, by: float = 1.0) -> float:
    return x * by


def check_call_arguments() -> None:
    # args (and no kwargs) are checked against func's parameters; so is a call with neither
    assert_type(rpc_sync("w1", scale, args=(2,)), float)
    assert_type(rpc_async("w1", scale, (2,)), Future[float])
    assert_type(remote("w1", scale, args=(2,)), RRef[float])
    assert_type(rpc_sync("w1", get_worker_info), WorkerInfo)
    rpc_sync("w1", scale, args=("2",))  # type: ignore[arg-type]
    rpc_async("w1", scale, args=(2, 3))  # type: ignore[arg-type]
    remote("w1", scale)  # type: ignore[arg-type]
    # with kwargs, only the result's type follows func
    assert_type(rpc_sync("w1", scale, args=(2,), kwargs={"by": 0.5}), float)
    assert_type(rpc_async("w1", scale, (2,), {"by": 0.5}), Future[float])
    assert_type(remote("w1", scale, kwargs={"x": 2}), RRef[float])


@async_execution
def later(x: int) -> Future[int]:
    fut: Future[int] = Future()
    fut.set_result(x)
    return fut


assert_type(later(1), Future[int])


def check_distributed_autograd() -> None:
    import rpc_registry.autograd as dist_autograd
    from rpc_registry.nn import RemoteModule
    from rpc_registry.optim import DistributedOptimizer

    with dist_autograd.context() as context_id:
        assert_type(context_id, int)
        dist_autograd.backward(context_id, [torch.ones(()).requires_grad_().sum()])
        assert_type(dist_autograd.get_gradients(context_id), dict[torch.Tensor, torch.Tensor])
    layer = RemoteModule("w1/cpu", torch.nn.Linear, args=(2, 2))
    assert_type(layer.remote_parameters(), list[RRef[torch.nn.Parameter]])
    assert_type(layer.forward_async(torch.ones(2)), Future[Any])
    optimizer = DistributedOptimizer(torch.optim.SGD, layer.remote_parameters(), lr=0.1)
    optimizer.step(0)
