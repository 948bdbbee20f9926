"""A downstream user's code: every public name used as documented, its types
asserted. Checked by mypy --strict against the installed wheels, and by
pyright in strict mode (torch's ``dist.all_reduce`` is partially unknown to
pyright, hence the ignores on its calls)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from typing_extensions import assert_type

import ddp_join
import join_core
import lightning_join
import rpc_registry
import rpc_registry as rpc
from ddp_join import DistributedDataParallel, GradBucket, ZeroRedundancyOptimizer, allreduce_hook
from join_core import (
    CollectiveMismatchError,
    Join,
    Joinable,
    JoinAbortedError,
    JoinHook,
    OwnedCollectives,
    ShadowCollectives,
)
from join_core.testing import RanksFailedError, run_ranks
from lightning_join import EvaluationSteps, JoinDDPStrategy, JoinFSDPStrategy, gather_all_tensors
from lightning_join.fabric import JoinDDPStrategy as FabricJoinDDPStrategy
from lightning_join.fabric import join as fabric_join
from rpc_registry import BackendType, BackendValue, RRef, WorkerInfo, backend_registered
from rpc_registry.functions import async_execution
from tensorpipe_backend import (
    TensorPipeAgent,
    TensorPipeRpcBackendOptions,
    create_reverse_mapping,
    validate_device_maps,
)


class CounterHook(JoinHook):
    def main_hook(self) -> None:
        dist.all_reduce(torch.zeros(1))  # pyright: ignore[reportUnknownMemberType]

    def post_hook(self, is_last_joiner: bool) -> None:
        assert_type(is_last_joiner, bool)


class Counter:
    """A structural Joinable: no base class needed."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None
        return group


class ExplicitCounter(Joinable):
    """An explicit subclass of the Protocol."""

    def __init__(self) -> None:
        super().__init__()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None
        return group


class TorchStyleCounter:
    """Typed as a joinable written for torch's Join: its group may be None (the default group)."""

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterHook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD


def train(rank: int, world_size: int) -> int:
    counter = Counter()
    joinables: list[Joinable] = [counter, ExplicitCounter(), TorchStyleCounter()]
    with Join(joinables, enable=True, throw_on_early_termination=False, any_hook_option=1) as join:
        assert_type(join, Join)
        for _ in range(rank + 1):
            assert_type(Join.notify_join_context(counter), dist.Work | None)
            slot = torch.tensor([Join.heartbeat_signal(counter)])
            dist.all_reduce(slot)  # pyright: ignore[reportUnknownMemberType]
            assert_type(Join.heartbeat_result(counter, float(slot)), bool)
    return rank


def train_ddp(rank: int, world_size: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(torch.nn.Linear(4, 1), bucket_cap_mb=25, find_unused_parameters=False)
    assert_type(model.module, torch.nn.Linear)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    assert_type(optimizer.optim, torch.optim.Optimizer)
    with model.join(divide_by_initial_world_size=True) as join:
        assert_type(join, Join)
    with Join([model, optimizer], throw_on_early_termination=False):
        with model.no_sync():
            model(torch.ones(2, 4)).sum().backward()
        model(torch.ones(2, 4)).sum().backward()
        assert_type(optimizer.step(), None)
    optimizer.consolidate_state_dict(to=0)
    assert_type(optimizer.state_dict(), dict[str, Any])
    return [p.detach() for p in model.parameters()]


def train_shadowed(rank: int, world_size: int) -> float:
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    shadow = ShadowCollectives(process_group=None)
    assert_type(shadow.join_process_group, dist.ProcessGroup)
    metric = torch.ones(1)
    try:
        with Join([model, shadow]):
            model(torch.ones(2, 4)).sum().backward()
            dist.all_reduce(metric)  # pyright: ignore[reportUnknownMemberType]
    except CollectiveMismatchError as mismatch:
        assert_type(mismatch, CollectiveMismatchError)
    return float(metric)


def halve(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    assert_type(bucket.buffer(), torch.Tensor)
    assert_type(bucket.divisor(), int)
    return allreduce_hook(state, bucket)


def tensorpipe_options() -> TensorPipeRpcBackendOptions:
    options = TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60.0, init_method="env://")
    options.set_device_map("worker1", {0: 1})
    options.set_devices([0])
    assert_type(options.rpc_timeout, float)
    assert_type(options.init_method, str)
    maps = {"worker0": options.device_maps, "worker1": {}}
    validate_device_maps(
        ["worker0", "worker1"], {"worker0": 2, "worker1": 2}, maps, {"worker0": [], "worker1": []}
    )
    assert_type(
        create_reverse_mapping("worker1", ["worker0", "worker1"], maps),
        dict[str, dict[torch.device, torch.device]],
    )
    rpc_registry.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=options)
    return options


def drop_in_names() -> None:
    """torch's spelling, ``import torch.distributed.rpc as rpc``, with ours instead."""
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4)
    assert_type(options, TensorPipeRpcBackendOptions)
    assert_type(options.num_worker_threads, int)
    assert_type(rpc.TensorPipeAgent, type[TensorPipeAgent])
    assert_type(rpc_registry.TensorPipeAgent, type[TensorPipeAgent])


def use_rpc() -> None:
    assert_type(backend_registered("TENSORPIPE"), bool)
    for member in BackendType:
        assert_type(member, BackendType)
        assert_type(member.value, BackendValue)
    assert_type(rpc_registry.get_worker_info(), WorkerInfo)
    assert_type(rpc_registry.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)), torch.Tensor)
    future = rpc_registry.rpc_async("worker1", torch.add, args=(torch.ones(1), 1), timeout=-1.0)
    assert_type(future, torch.futures.Future[torch.Tensor])
    rref = rpc_registry.remote("worker1", torch.ones, args=([2],))
    assert_type(rref, RRef[torch.Tensor])
    assert_type(rref.to_here(timeout=5.0), torch.Tensor)
    assert_type(rref.owner(), WorkerInfo)
    assert_type(
        rpc_registry.rpc_sync("worker1", torch.ones, args=([2],), kwargs={"dtype": torch.int64}), torch.Tensor
    )
    rpc_registry.rpc_sync("worker1", torch.add, args=(torch.ones(1), "1"))  # type: ignore[arg-type]
    rpc_registry.remote("worker1", WorkerInfo, args=("worker1",))  # type: ignore[arg-type]
    rpc_registry.shutdown(graceful=True)


@async_execution
def later(x: int) -> torch.futures.Future[int]:
    future: torch.futures.Future[int] = torch.futures.Future()
    future.set_result(x)
    return future


def lightning_strategies() -> None:
    """Not run: the strategies' arguments and the Fabric join, typed."""
    strategy = JoinDDPStrategy(
        exact_eval=True,
        throw_on_early_termination=False,
        divide_by_initial_world_size=True,
        find_unused_parameters=True,
    )
    assert_type(strategy.exact_eval, bool)
    fsdp_strategy = JoinFSDPStrategy(data_parallel_size="auto", tensor_parallel_size=1, exact_eval=True)
    assert_type(fsdp_strategy.divide_by_initial_world_size, bool)
    fabric_strategy = FabricJoinDDPStrategy(divide_by_initial_world_size=False)
    assert_type(fabric_strategy.join(), Join)
    with fabric_join(Fabric(strategy=fabric_strategy)):
        pass
    steps = EvaluationSteps()
    with Join([steps, ShadowCollectives()]):
        steps.step()
        with OwnedCollectives("EvaluationSteps") as owned:
            assert_type(owned.owner, str)
        owned.begin(backward=True)
        owned.end()
        assert_type(gather_all_tensors(torch.zeros(2)), list[torch.Tensor])
    assert_type(lightning_join.__all__, list[str])


def main() -> None:
    try:
        ranks = run_ranks(train, 2, timeout=60.0)
        assert_type(ranks, list[int])
    except RanksFailedError as error:
        assert_type(error.failures, dict[int, str])
    except JoinAbortedError as aborted:
        assert_type(aborted.failures, dict[int, str])
    assert_type(JoinHook().carries_heartbeat, bool)
    assert_type(join_core.__all__, list[str])
    assert_type(ddp_join.__all__, list[str])
    assert_type(run_ranks(train_ddp, 2), list[list[torch.Tensor]])
    assert_type(run_ranks(train_shadowed, 2), list[float])
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    model.register_comm_hook(None, halve)
    use_rpc()
    drop_in_names()
    assert_type(later(1), torch.futures.Future[int])


if __name__ == "__main__":
    main()
