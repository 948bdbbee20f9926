"""Pickling the wrapper (``torch.save(model)``) as torch's: only over the
default process group; the loaded wrapper trains like the original, without
its communication hook; torch's buffer and device attributes."""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_cases import batch, loss_fn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddp_join import DistributedDataParallel, GradBucket, allreduce_hook
from join_core.testing import run_ranks

_IGNORED = "last.bias"  # left out of every reduction: its gradient stays each rank's own


class _Net(torch.nn.Module):
    """Two layers used, one never used, a BatchNorm's buffers and a buffer that forward reassigns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.last = torch.nn.Linear(8, 2)
        self.unused = torch.nn.Linear(2, 2)
        self.seen: torch.Tensor
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + len(x)
        out: torch.Tensor = self.last(torch.tanh(self.norm(self.first(x))))
        return out


@dataclass(frozen=True)
class _Precision:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


_KEPT = (
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "forward_sync_buffers",
    "mixed_precision",
    "parameters_to_ignore",
    "bucket_bytes_cap",
    "bucket_bytes_cap_list",
    "bucket_bytes_cap_default",
    "device",
    "training",
)

_Grads = list[dict[str, torch.Tensor | None]]


def _train(model: DistributedDataParallel[_Net], rank: int) -> _Grads:
    """Each step's gradients, by parameter name (None where a parameter has none)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps: _Grads = []
    for step in range(3):
        optimizer.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        steps.append(
            {n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()}
        )
        optimizer.step()
    return steps


def _round_trip(rank: int, world_size: int, arguments: dict[str, Any]) -> tuple[_Grads, _Grads, list[bool]]:
    module = _Net()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, [_IGNORED])
    original = DistributedDataParallel(module, **arguments)
    original.eval()
    saved = io.BytesIO()
    torch.save(original, saved)
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
    assert type(loaded) is DistributedDataParallel and loaded.module is not original.module
    for name in _KEPT:
        assert getattr(loaded, name) == getattr(original, name), name
    assert loaded.process_group is dist.group.WORLD
    original.train()
    loaded.train()
    theirs, ours = _train(original, rank), _train(loaded, rank)
    views = [p.grad is not None and p.grad._base is not None for p in loaded.module.parameters()]
    return theirs, ours, views


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param(
            {
                "bucket_cap_mb": 0.0001,
                "find_unused_parameters": True,
                "gradient_as_bucket_view": True,
                "forward_sync_buffers": False,
            },
            id="unused-views",
        ),
        pytest.param(
            {
                "bucket_cap_mb_list": [0.0001, 1.0],
                "static_graph": True,
                "mixed_precision": _Precision(reduce_dtype=torch.float64),
            },
            id="static-mixed",
        ),
    ],
)
def test_an_unpickled_wrapper_averages_gradients_as_the_original_did(arguments: dict[str, Any]) -> None:
    results = run_ranks(_round_trip, 2, arguments)
    for original, loaded, views in results:
        for theirs, ours in zip(original, loaded):
            assert theirs.keys() == ours.keys()
            for name, grad in theirs.items():
                other = ours[name]
                assert (grad is None) == (other is None), name
                if grad is not None and other is not None:
                    assert torch.equal(grad, other), name
        assert any(views) == arguments.get("gradient_as_bucket_view", False)
    for step in range(3):
        first, second = results[0][1][step], results[1][1][step]
        if arguments.get("find_unused_parameters") or arguments.get("static_graph"):
            assert first["unused.weight"] is None and second["unused.weight"] is None
        for name, grad in first.items():
            other = second[name]
            if grad is not None and other is not None:  # averaged, save the ignored one
                assert torch.equal(grad, other) != (name == _IGNORED), name


def _mesh_round_trip(rank: int, world_size: int) -> tuple[bool, bool, torch.Tensor]:
    model = DistributedDataParallel(torch.nn.Linear(4, 2), device_mesh=init_device_mesh("cpu", (world_size,)))
    loaded = pickle.loads(pickle.dumps(model))
    loss_fn(loaded, *batch(rank, 0)).backward()
    assert loaded.module.weight.grad is not None
    return loaded.device_mesh is not None, loaded.process_group is dist.group.WORLD, loaded.module.weight.grad


def test_a_wrapper_over_a_device_mesh_of_the_world_pickles_as_torchs() -> None:
    (mesh, world, first), (_, _, second) = run_ranks(_mesh_round_trip, 2)
    assert mesh and world
    assert torch.equal(first, second)


_CALLS: list[str] = []


def _our_hook(state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    _CALLS.append("ours")
    return allreduce_hook(state, bucket)


def _torch_hook(state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    _CALLS.append("torch")
    return default_hooks.allreduce_hook(state, bucket)  # type: ignore[arg-type]


# torch checks the annotations' values, which this module's future import leaves as strings.
_torch_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}  # type: ignore[attr-defined]
)


def _hook_after_loading(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    loaded: dict[str, Any] = {}
    for name, wrapper, hook in (
        ("ours", DistributedDataParallel, _our_hook),
        ("torch", TorchDDP, _torch_hook),
    ):
        model = wrapper(torch.nn.Linear(4, 2))
        model.register_comm_hook(None, hook)
        loaded[name] = pickle.loads(pickle.dumps(model))
    _CALLS.clear()
    for model in loaded.values():
        loss_fn(model, *batch(rank, 0)).backward()
    dropped = list(_CALLS)
    loaded["ours"].register_comm_hook(None, _our_hook)  # again, on the loaded wrapper
    loss_fn(loaded["ours"], *batch(rank, 1)).backward()
    return dropped, _CALLS[len(dropped) :]


def test_pickling_drops_the_communication_hook_as_torchs() -> None:
    for dropped, registered_again in run_ranks(_hook_after_loading, 2):
        assert dropped == []
        assert registered_again == ["ours"]


def _pickle_over(rank: int, world_size: int) -> tuple[str, str]:
    group = dist.new_group(list(range(world_size)))  # every rank, but not the default group
    messages = []
    for wrapper in (DistributedDataParallel, TorchDDP):
        with pytest.raises(RuntimeError) as refused:
            pickle.dumps(wrapper(torch.nn.Linear(4, 2), process_group=group))
        messages.append(str(refused.value))
    return messages[0], messages[1]


def test_pickling_a_wrapper_over_another_group_is_refused_naming_the_fix() -> None:
    ours, theirs = run_ranks(_pickle_over, 2)[0]
    assert ours == (
        "DDP Pickling/Unpickling are only supported when using DDP with the default process group: "
        "this DistributedDataParallel reduces over another one (its process_group or device_mesh "
        "argument, or the survivors' group after a rank was lost); pickle model.module or "
        "model.state_dict() instead, or wrap the module without process_group and device_mesh"
    )
    assert ours.startswith(theirs.split(".")[0])  # torch's own words first


def _pickled(rank: int, world_size: int) -> bytes:
    return pickle.dumps(DistributedDataParallel(torch.nn.Linear(4, 2)))


def test_unpickling_without_a_default_process_group_is_refused_naming_init_process_group() -> None:
    (pickled,) = run_ranks(_pickled, 1)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as refused:
        pickle.loads(pickled)
    assert str(refused.value) == (
        "unpickling DistributedDataParallel: the default process group is not initialized; "
        "call torch.distributed.init_process_group() first"
    )


def _pickled_after_destroying_the_group(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    dist.destroy_process_group()
    with pytest.raises(RuntimeError) as refused:
        pickle.dumps(model)
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # for run_ranks to end
    return str(refused.value)


def test_pickling_after_the_process_group_is_destroyed_says_so() -> None:
    # It said that the wrapper reduces over another group.
    assert run_ranks(_pickled_after_destroying_the_group, 1) == [
        "DDP Pickling/Unpickling are only supported when using DDP with the default process group: no "
        "default process group is initialized (destroyed?); pickle model.module or model.state_dict() "
        "instead, or pickle the wrapper before destroy_process_group()"
    ]


_ATTRIBUTES = ("is_multi_device_module", "skip_all_reduce_unused_params", "use_side_stream_for_tensor_copies")


def _attributes(rank: int, world_size: int) -> list[tuple[str, Any, Any]]:
    differences = []
    for side_stream in (None, "0"):
        if side_stream is not None:
            os.environ["PYTORCH_DDP_USE_SIDE_STREAM"] = side_stream
        ours = DistributedDataParallel(_ignoring_running_var(_Net()))
        theirs = TorchDDP(_ignoring_running_var(_Net()), find_unused_parameters=True)
        for name in _ATTRIBUTES:
            differences.append((name, getattr(ours, name), getattr(theirs, name)))
        for model in (ours, theirs):
            loss_fn(model, *batch(rank, 0)).backward()  # reassigns module.seen
            assert list(model.named_module_buffers) == [
                "seen",
                "norm.running_mean",
                "norm.num_batches_tracked",
            ]
            assert list(map(id, model.modules_buffers)) == list(map(id, model.named_module_buffers.values()))
        # torch's are read again at its next broadcast; ours are the module's buffers now.
        assert ours.named_module_buffers["seen"] is ours.module.seen
    return differences


def _ignoring_running_var(module: _Net) -> _Net:
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["norm.running_var"])
    return module


def test_buffer_and_device_attributes_have_torchs_values() -> None:
    for name, ours, theirs in run_ranks(_attributes, 2)[0]:
        assert ours == theirs, name
