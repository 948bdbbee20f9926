"""torch 2.13's DistributedDataParallel and ZeroRedundancyOptimizer arguments:
the same signature, each implemented option checked against torch's DDP or a
single-process reference (also under Join with uneven inputs), the others
rejected by name."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
import inspect
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from ddp_cases import batch, flat_params, loss_fn, make_model, reference
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import ddp_join
from ddp_join import (
    DistributedDataParallel,
    GradBucket,
    ZeroRedundancyOptimizer,
    allreduce_hook,
    fp16_compress_wrapper,
    hook_with_zero_step,
)
from join_core import Join
from join_core.testing import run_ranks


def _parameters(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.skipif(
    torch.__version__ < "2.13",  # a TorchVersion compares with version strings
    reason="the signatures followed are torch 2.13's; an older torch's have fewer arguments",
)
def test_constructors_take_torchs_arguments_in_torchs_order_with_torchs_defaults() -> None:
    assert _parameters(DistributedDataParallel.__init__) == _parameters(TorchDDP.__init__)
    with warnings.catch_warnings():
        # Importing torch.distributed.optim scripts functional optimizers with torch.jit.
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
            hook_with_zero_step as torch_hook,
        )
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    assert _parameters(ZeroRedundancyOptimizer.__init__) == _parameters(TorchZero.__init__)
    assert _parameters(hook_with_zero_step) == _parameters(torch_hook)
    assert _parameters(ZeroRedundancyOptimizer.step) == _parameters(TorchZero.step)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        assert _parameters(getattr(ddp_join, name)) == _parameters(getattr(default_hooks, name)), name
    for name in ("fp16_compress_wrapper", "bf16_compress_wrapper"):
        assert _parameters(getattr(ddp_join, name)) == _parameters(getattr(default_hooks, name)), name
    methods = {name for name in dir(torch.distributed.GradBucket) if not name.startswith("_")}  # type: ignore[attr-defined]
    assert methods <= set(dir(GradBucket)), methods - set(dir(GradBucket))
    for method in ("will_sync_module_buffers", "to_kwargs", "scatter", "gather"):
        ours, theirs = getattr(DistributedDataParallel, method), getattr(TorchDDP, method)
        assert [name for name, _ in _parameters(ours)] == [name for name, _ in _parameters(theirs)]


@dataclass(frozen=True)
class _Precision:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None


def _rejections(rank: int, world_size: int) -> dict[str, Any]:
    linear = torch.nn.Linear(2, 2)
    attempts: dict[str, Any] = {
        "delay": lambda: DistributedDataParallel(
            linear,
            delay_all_reduce_named_params=[("weight", linear.weight)],
            param_to_hook_all_reduce=linear.bias,
        ),
        "skip": lambda: DistributedDataParallel(linear, skip_all_reduce_unused_params=True),
        "param_dtype": lambda: DistributedDataParallel(
            linear, mixed_precision=_Precision(param_dtype=torch.float16)
        ),
        "mesh_and_group": lambda: DistributedDataParallel(
            linear, process_group=dist.group.WORLD, device_mesh=init_device_mesh("cpu", (world_size,))
        ),
        "cap_list": lambda: DistributedDataParallel(linear, bucket_cap_mb_list=[]),
        "cap_nan": lambda: DistributedDataParallel(linear, bucket_cap_mb=float("nan")),
        "cap_str": lambda: DistributedDataParallel(linear, bucket_cap_mb="25"),  # type: ignore[arg-type]
        "cap_list_int": lambda: DistributedDataParallel(linear, bucket_cap_mb_list=5),  # type: ignore[arg-type]
        "cap_list_inf": lambda: DistributedDataParallel(linear, bucket_cap_mb_list=[1.0, math.inf]),
        "overlap": lambda: hook_with_zero_step(
            allreduce_hook,
            DistributedDataParallel(linear),
            ZeroRedundancyOptimizer(linear.parameters(), torch.optim.SGD, lr=0.1),
        ),
    }
    messages: dict[str, Any] = {}
    for name, make in attempts.items():
        try:
            make()
            messages[name] = "accepted"
        except (ValueError, RuntimeError) as error:
            messages[name] = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedDataParallel(linear, broadcast_buffers=True, check_reduction=True, batched_grad_copy=True)
    messages["warnings"] = sorted(f"{w.category.__name__}: {w.message}" for w in caught)
    plain = DistributedDataParallel(linear)
    norm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    messages["will_sync"] = [
        plain.will_sync_module_buffers(),
        DistributedDataParallel(norm).will_sync_module_buffers(),
        DistributedDataParallel(norm, forward_sync_buffers=False).will_sync_module_buffers(),
        DistributedDataParallel(norm, broadcast_buffers=False).will_sync_module_buffers(),
    ]
    x, y = torch.ones(2, 3), torch.zeros(1)
    messages["to_kwargs"] = (
        plain.to_kwargs((x, [y]), {"k": y}, 0),
        TorchDDP(linear).to_kwargs((x, [y]), {"k": y}, 0),
    )
    return messages


def test_unsupported_arguments_are_rejected_by_name_and_no_ops_are_accepted() -> None:
    messages = run_ranks(_rejections, 2)[0]
    assert "delay_all_reduce_named_params=..., param_to_hook_all_reduce=...): delaying" in messages["delay"]
    assert "skip_all_reduce_unused_params=True): not supported; leave it False" in messages["skip"]
    assert (
        "mixed_precision.param_dtype=torch.float16): only reduce_dtype is supported"
        in messages["param_dtype"]
    )
    assert messages["mesh_and_group"].startswith(
        "Cannot specify both process_group and device_mesh arguments"
    )
    assert "bucket_cap_mb_list=[]): must be a non-empty list" in messages["cap_list"]
    assert "bucket_cap_mb=nan): must be positive (a size in MiB), or None" in messages["cap_nan"]
    assert "bucket_cap_mb='25'): must be positive" in messages["cap_str"]
    assert "bucket_cap_mb_list=5): must be a non-empty list" in messages["cap_list_int"]
    assert "bucket_cap_mb_list=[1.0, inf]): must be a non-empty list" in messages["cap_list_inf"]
    assert "built with overlap_with_ddp=False" in messages["overlap"]
    assert len(messages["warnings"]) == 2
    assert messages["warnings"][0].startswith("FutureWarning: DistributedDataParallel(broadcast_buffers=...)")
    assert messages["warnings"][1].startswith("FutureWarning: DistributedDataParallel(check_reduction=True)")
    assert messages["will_sync"] == [False, True, False, False]
    ours, theirs = messages["to_kwargs"]
    assert repr(ours) == repr(theirs)


class _Pair(NamedTuple):
    x: torch.Tensor
    y: list[torch.Tensor]


def _structure(value: Any) -> Any:
    """The types in ``value``, nested as it is, with each tensor's values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_structure(item) for item in value])
    if isinstance(value, dict):
        return (type(value).__name__, {key: _structure(item) for key, item in value.items()})
    return (type(value).__name__, value)


class _NoUpdate(dict[str, torch.Tensor]):
    def update(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("update() is not allowed")


def _moved_inputs(rank: int, world_size: int) -> tuple[Any, Any]:
    x, y = torch.ones(2, 3), torch.zeros(1)
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3), torch.ones(2)])
    inputs = (_Pair(x, [y]), packed, collections.OrderedDict(b=y, a=x), 7)
    kwargs = {"k": [y]}
    linear = torch.nn.Linear(2, 2)
    ours = DistributedDataParallel(linear).to_kwargs(inputs, kwargs, 0)
    theirs = TorchDDP(linear).to_kwargs(inputs, kwargs, 0)
    # torch's fails on a defaultdict (it builds one with the items as its factory).
    ((moved,),), _ = DistributedDataParallel(linear).to_kwargs((collections.defaultdict(list, k=[y]),), {}, 0)
    assert type(moved) is collections.defaultdict and moved.default_factory is list, moved
    # A dict that refuses update() (as transformers' ModelOutput) is rebuilt as torch rebuilds it.
    ((output,),), _ = DistributedDataParallel(linear).to_kwargs((_NoUpdate(k=y),), {}, 0)
    assert type(output) is _NoUpdate and torch.equal(output["k"], y), output
    return _structure(ours), _structure(theirs)


def test_to_kwargs_keeps_named_tuples_dicts_and_packed_sequences_as_torchs() -> None:
    # A named tuple came back a plain tuple, a PackedSequence a tuple of tensors, an
    # OrderedDict a dict; forward moves inputs with it (device_ids), so a CUDA module got those.
    ours, theirs = run_ranks(_moved_inputs, 1)[0]
    assert ours == theirs


class _Squares(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 3))
        self.bias = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x @ self.weight + self.bias) ** 2).sum()


def _backward_creating_a_graph(rank: int, world_size: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(_Squares())
    x = torch.full((4, 2), float(rank + 1))
    model(x).backward(create_graph=True)
    return [param.grad.detach().clone() for param in model.parameters() if param.grad is not None]


def test_backward_with_create_graph_averages_the_gradients() -> None:
    # The bucket copies were recorded by autograd: "a leaf Variable that requires grad is being
    # used in an in-place operation" (torch's fails the same way with two parameters or more).
    results = run_ranks(_backward_creating_a_graph, 2)
    local = []
    for rank in range(2):
        module = _Squares()
        module(torch.full((4, 2), float(rank + 1))).backward()
        local.append([param.grad for param in module.parameters() if param.grad is not None])
    expected = [(first + second) / 2 for first, second in zip(*local)]
    for grads in results:
        assert len(grads) == 2
        for grad, want in zip(grads, expected):
            torch.testing.assert_close(grad, want)


def _cpu_inputs_to_a_cuda_module(rank: int, world_size: int) -> tuple[str, str]:
    linear = torch.nn.Linear(3, 2).cuda()
    ours, theirs = DistributedDataParallel(linear, device_ids=[0]), TorchDDP(linear, device_ids=[0])
    x = torch.ones(4, 3)
    return str(ours(x).device), str(theirs(x).device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_module_with_device_ids_takes_cpu_inputs_as_torchs() -> None:
    # The CPU batch reached the CUDA module as it was (a device mismatch in the module).
    assert run_ranks(_cpu_inputs_to_a_cuda_module, 1)[0] == ("cuda:0", "cuda:0")


def _running_mean(norm: torch.nn.BatchNorm1d) -> torch.Tensor:
    mean = norm.running_mean
    assert mean is not None
    return mean


class _NormNet(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(4, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        _running_mean(self.norm).fill_(float(seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.linear(x))
        return out


def _construction_sync(rank: int, world_size: int) -> dict[str, list[float]]:
    def state(**kwargs: Any) -> list[float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = DistributedDataParallel(_NormNet(seed=rank), **kwargs)
        return [*flat_params(model).tolist(), *_running_mean(model.module.norm).tolist()]

    x = torch.ones(3, 4)
    model = DistributedDataParallel(_NormNet(seed=rank), forward_sync_buffers=False)
    _running_mean(model.module.norm).fill_(float(rank))
    model(x)  # buffers are not broadcast: each rank's statistics stay its own
    return {
        "default": state(),
        "no_init_sync": state(init_sync=False),
        "broadcast_buffers_false": state(broadcast_buffers=False),
        "forward_sync_false": state(forward_sync_buffers=False),
        "after_forward": _running_mean(model.module.norm).tolist(),
    }


def test_init_sync_and_buffer_flags_decide_what_is_broadcast() -> None:
    first, second = run_ranks(_construction_sync, 2)
    assert first["default"] == second["default"]
    assert first["no_init_sync"] != second["no_init_sync"]  # each rank keeps its own initialization
    # broadcast_buffers=False: parameters broadcast, buffers not (torch's deprecated meaning).
    assert first["broadcast_buffers_false"][:-2] == second["broadcast_buffers_false"][:-2]
    assert first["broadcast_buffers_false"][-2:] != second["broadcast_buffers_false"][-2:]
    # forward_sync_buffers=False still broadcasts buffers at construction.
    assert first["forward_sync_false"] == second["forward_sync_false"]
    assert first["after_forward"] != second["after_forward"]


def _broadcast_buffers_attribute(rank: int, world_size: int) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    for name, wrapper in (("ours", DistributedDataParallel), ("torch", TorchDDP)):
        flags[name] = [
            wrapper(_NormNet(seed=0)).broadcast_buffers,
            wrapper(_NormNet(seed=0), forward_sync_buffers=False).broadcast_buffers,
        ]
    model = DistributedDataParallel(_NormNet(seed=rank))
    model.broadcast_buffers = False  # as torch's: turns the forward's buffer broadcast off
    _running_mean(model.module.norm).fill_(float(rank))
    model(torch.ones(3, 4))
    flags["forward_sync_buffers"] = model.forward_sync_buffers
    flags["after_forward"] = _running_mean(model.module.norm).tolist()
    return flags


def test_broadcast_buffers_attribute_reads_and_sets_forward_sync_buffers_as_torchs() -> None:
    first, second = run_ranks(_broadcast_buffers_attribute, 2)
    assert first["ours"] == first["torch"] == [True, False]
    assert first["forward_sync_buffers"] is False
    assert first["after_forward"] != second["after_forward"]


_SIZE_ATTRIBUTES = (
    "bucket_bytes_cap",
    "bucket_bytes_cap_list",
    "bucket_bytes_cap_default",
    "broadcast_bucket_size",
)


def _size_attributes(rank: int, world_size: int) -> list[tuple[object, object]]:
    found = []
    for kwargs in ({}, {"bucket_cap_mb": 5}, {"bucket_cap_mb": 0.5}, {"bucket_cap_mb_list": [1, 3, 2]}):
        ours = DistributedDataParallel(torch.nn.Linear(4, 2), **kwargs)
        theirs = TorchDDP(torch.nn.Linear(4, 2), **kwargs)
        found += [(getattr(ours, name), getattr(theirs, name)) for name in _SIZE_ATTRIBUTES]
    return found


def test_bucket_size_attributes_are_torchs() -> None:
    # Code written for torch's wrapper reads them (e.g. to size its own buckets); ours had none.
    (found,) = run_ranks(_size_attributes, 1)
    assert [ours for ours, _ in found] == [theirs for _, theirs in found]


class _Checkpointed(torch.nn.Module):
    """Reentrant activation checkpointing of a layer used twice, and a
    parameter no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 2)
        self.unused = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.shared, h, use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        out: torch.Tensor = self.out(h)
        return out


def _static(rank: int, world_size: int, steps: int, ours: bool, join: bool) -> tuple[torch.Tensor, bool]:
    module = _Checkpointed()
    model: torch.nn.Module
    if ours:
        model = DistributedDataParallel(module, static_graph=True, bucket_cap_mb=0.0001)
    else:
        model = TorchDDP(module, static_graph=True, bucket_cap_mb=0.0001)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]) if join else contextlib.nullcontext():
        for step in range(steps + (rank if join else 0)):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, *batch(rank, step)).backward()
            optimizer.step()
    return flat_params(model), module.unused.weight.grad is None


def test_static_graph_matches_torchs_with_reentrant_checkpointing_and_an_unused_parameter() -> None:
    theirs = run_ranks(_static, 2, 4, False, False)
    ours = run_ranks(_static, 2, 4, True, False)
    assert torch.equal(ours[0][0], ours[1][0])
    torch.testing.assert_close(ours[0][0], theirs[0][0], rtol=1e-5, atol=1e-6)
    assert ours[0][1] and ours[1][1]  # no rank used it: .grad stays None


def test_static_graph_under_join_with_uneven_inputs_matches_a_single_process() -> None:
    results = run_ranks(_static, 2, 3, True, True)
    assert torch.equal(results[0][0], results[1][0])
    model = _Checkpointed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        active = [rank for rank in range(2) if step < 3 + rank]
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in active:
            model.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            for acc, p in zip(total, model.parameters()):
                if p.grad is not None:
                    acc += p.grad
        for acc, p in zip(total, model.parameters()):
            p.grad = acc / 2
        optimizer.step()
    torch.testing.assert_close(results[0][0], flat_params(model), rtol=1e-5, atol=1e-6)


def _reentrant_without_static_graph(rank: int, world_size: int, ours: bool, find_unused: bool) -> str:
    ddp = DistributedDataParallel if ours else TorchDDP
    model = ddp(_Checkpointed(), find_unused_parameters=find_unused)
    try:
        loss_fn(model, *batch(rank, 0)).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("find_unused", [False, True], ids=["all-used", "find_unused_parameters"])
def test_a_parameter_reused_by_reentrant_checkpoints_fails_as_torchs_without_static_graph(
    find_unused: bool,
) -> None:
    # Its second gradient came after it was counted: silently dropped (or, found unused, reduced as
    # zeros and .grad left local) before; torch raises.
    for ours in (False, True):
        messages = run_ranks(_reentrant_without_static_graph, 2, ours, find_unused)
        assert all("Expected to mark a variable ready only once" in m for m in messages), (ours, messages)
    assert "static_graph=True" in messages[0] and "use_reentrant=False" in messages[0]


def _gradient_penalty(rank: int, world_size: int, ours: bool, find_unused: bool) -> torch.Tensor:
    ddp = DistributedDataParallel if ours else TorchDDP
    model = ddp(make_model(), find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        x.requires_grad_(True)
        out = model(x)
        # A pass that accumulates nothing into .grad, before the iteration's backward.
        (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (torch.nn.functional.mse_loss(out, y) + dx.pow(2).mean()).backward()
        optimizer.step()
    return flat_params(model)


@pytest.mark.parametrize("find_unused", [False, True], ids=["all-used", "find_unused_parameters"])
def test_a_gradient_penalty_through_autograd_grad_is_reduced_with_the_backward_as_torchs(
    find_unused: bool,
) -> None:
    theirs = run_ranks(_gradient_penalty, 2, False, False)
    ours = run_ranks(_gradient_penalty, 2, True, find_unused)
    assert torch.equal(ours[0], ours[1])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


class _Reassigning(torch.nn.Module):
    """Replaces its buffer in each forward (a new tensor, as ``self.seen = self.seen + n`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.seen: torch.Tensor
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + x.shape[0] * (dist.get_rank() + 1)
        out: torch.Tensor = self.linear(x)
        return out


def _reassigned_buffer(rank: int, world_size: int, ours: bool) -> list[float]:
    torch.manual_seed(0)
    module = _Reassigning()
    model = DistributedDataParallel(module) if ours else TorchDDP(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(3):
        optimizer.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        optimizer.step()
        seen.append(float(module.seen))
    return seen


def test_a_buffer_reassigned_in_forward_is_still_broadcast_as_torchs() -> None:
    ours = run_ranks(_reassigned_buffer, 2, True)
    assert ours == run_ranks(_reassigned_buffer, 2, False)
    assert ours[1] == [10.0, 15.0, 20.0]  # rank 0's count before each forward, plus its own 5 * 2


def _nested_round_trip(rank: int, world_size: int) -> None:
    parent = torch.nn.ModuleDict({"g": DistributedDataParallel(make_model())})
    state = parent.state_dict()
    assert all(key.startswith("g.") and not key.startswith("g.module.") for key in state), list(state)
    other = torch.nn.ModuleDict({"g": DistributedDataParallel(make_model(seed=1))})
    other.load_state_dict(state)
    assert torch.equal(flat_params(other["g"]), flat_params(parent["g"]))
    # A checkpoint saved with torch's wrapper (keys under "g.module.") loads too.
    torch_style = {key.replace("g.", "g.module.", 1): value for key, value in state.items()}
    third = torch.nn.ModuleDict({"g": DistributedDataParallel(make_model(seed=2))})
    third.load_state_dict(torch_style)
    assert torch.equal(flat_params(third["g"]), flat_params(parent["g"]))
    # An inner module with a child named "module": its keys look like torch's, and are not.
    holder = torch.nn.Module()
    holder.module = make_model()
    nested = torch.nn.ModuleDict({"g": DistributedDataParallel(holder)})
    other_holder = torch.nn.Module()
    other_holder.module = make_model(seed=1)
    torch.nn.ModuleDict({"g": DistributedDataParallel(other_holder)}).load_state_dict(nested.state_dict())
    assert torch.equal(flat_params(other_holder), flat_params(holder))


def test_a_parent_module_saves_and_loads_the_wrapper_in_its_state_dict() -> None:
    run_ranks(_nested_round_trip, 1)


class _WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out


def _never_used_with_views(rank: int, world_size: int, ours: bool) -> tuple[torch.Tensor, bool]:
    module = _WithUnused()
    ddp = DistributedDataParallel if ours else TorchDDP
    model = ddp(module, gradient_as_bucket_view=True, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    for step in range(3):
        optimizer.zero_grad(set_to_none=False)
        loss_fn(model, *batch(rank, step)).backward()
        optimizer.step()
    return flat_params(model), module.unused.weight.grad is None


def test_a_parameter_never_used_keeps_no_gradient_with_bucket_views_as_torchs() -> None:
    # Its .grad was a zero view of the bucket from the start: AdamW's weight decay moved it.
    theirs = run_ranks(_never_used_with_views, 2, False)
    ours = run_ranks(_never_used_with_views, 2, True)
    assert ours[0][1] and theirs[0][1]
    torch.testing.assert_close(ours[0][0], theirs[0][0], rtol=1e-5, atol=1e-6)


def _deep_copied(rank: int, world_size: int) -> torch.Tensor:
    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001)
    ema = copy.deepcopy(model)
    assert type(ema) is DistributedDataParallel
    assert ema.module is not model.module
    assert ema.find_unused_parameters == model.find_unused_parameters
    assert torch.equal(flat_params(ema), flat_params(model))
    for wrapper in (model, ema):  # each reduces its own gradients
        optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.1)
        loss_fn(wrapper, *batch(rank, 0)).backward()
        optimizer.step()
    assert torch.equal(flat_params(ema), flat_params(model))
    return flat_params(ema)


def test_a_deep_copy_of_the_wrapper_is_a_wrapper_that_trains_on_its_own_as_torchs() -> None:
    first, second = run_ranks(_deep_copied, 2)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, reference([1, 1], lambda ps: torch.optim.SGD(ps, lr=0.1)))


def _with_ignored(rank: int, world_size: int, ours: bool) -> torch.Tensor:
    torch.manual_seed(rank)  # each rank's own values: the ignored layer keeps them
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    ddp = DistributedDataParallel if ours else TorchDDP
    ddp._set_params_and_buffers_to_ignore_for_model(module, ["2.weight", "2.bias"])
    model = ddp(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        optimizer.step()
    return flat_params(module)


def test_parameters_set_to_be_ignored_are_neither_broadcast_nor_reduced_as_torchs() -> None:
    ours, theirs = run_ranks(_with_ignored, 2, True), run_ranks(_with_ignored, 2, False)
    for rank in range(2):
        torch.testing.assert_close(ours[rank], theirs[rank], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours[0][-10:], ours[1][-10:])  # the ignored layer differs between ranks
    assert torch.equal(ours[0][:20], ours[1][:20])


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor


class _DataclassOutput(_WithUnused):
    def forward(self, x: torch.Tensor) -> _Output:  # type: ignore[override]
        return _Output(self.used(x))


def _dataclass_output(rank: int, world_size: int, ours: bool) -> torch.Tensor:
    ddp = DistributedDataParallel if ours else TorchDDP
    model = ddp(_DataclassOutput(), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x).logits, y).backward()
        optimizer.step()
    return flat_params(model)


def test_find_unused_parameters_looks_for_the_outputs_inside_a_dataclass_as_torchs() -> None:
    ours, theirs = run_ranks(_dataclass_output, 2, True), run_ranks(_dataclass_output, 2, False)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


class _SecondUsedOnRankOne(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 2)
        self.second = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out + self.second(x) if dist.get_rank() == 1 else out


def _input_gradient_then_train(rank: int, world_size: int, ours: bool) -> torch.Tensor:
    ddp = DistributedDataParallel if ours else TorchDDP
    # The ranks' unused parameters differ: a pass that launched reductions of its own would
    # leave them out of step.
    model = ddp(_SecondUsedOnRankOne(), find_unused_parameters=True, bucket_cap_mb=0.0001)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        x, y = batch(rank, step)
        x.requires_grad_(True)
        # An adversarial example: a forward whose only backward is torch.autograd.grad.
        (dx,) = torch.autograd.grad(model(x).sum(), x)
        loss_fn(model, (x + 0.1 * dx.sign()).detach(), y).backward()
        optimizer.step()
    return flat_params(model)


def test_forwards_followed_by_autograd_grad_alone_leave_the_reduction_to_the_next_backward() -> None:
    ours, theirs = (
        run_ranks(_input_gradient_then_train, 2, True),
        run_ranks(_input_gradient_then_train, 2, False),
    )
    assert torch.equal(ours[0], ours[1])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


def _reduce_in(rank: int, world_size: int, steps: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(make_model(), mixed_precision=_Precision(reduce_dtype=torch.float16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[torch.Tensor] = []
    with model.join():
        for step in range(steps + rank):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            optimizer.step()
    return [flat_params(model), *grads]


def test_mixed_precision_reduces_gradients_in_reduce_dtype_and_casts_back() -> None:
    results = run_ranks(_reduce_in, 2, 2)
    assert torch.equal(results[0][0], results[1][0])
    # The single-process reference, reducing each step's gradients in float16.
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    exact: list[torch.Tensor] = []
    halved: list[torch.Tensor] = []
    for step in range(3):
        sums = [torch.zeros_like(p, dtype=torch.float16) for p in model.parameters()]
        exact = [torch.zeros_like(p) for p in model.parameters()]
        for rank in (r for r in range(2) if step < 2 + r):
            model.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            for acc, full, p in zip(sums, exact, model.parameters()):
                assert p.grad is not None
                acc += p.grad.half()
                full += p.grad
        halved = [(acc / 2).float() for acc in sums]
        for p, grad in zip(model.parameters(), halved):
            p.grad = grad
        optimizer.step()
    last = results[1][1:]  # rank 1 trained the last step, rank 0 had joined
    assert all(grad.dtype == torch.float32 for grad in last)
    for ours, expected, full in zip(last, halved, exact):
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-8)
        assert not torch.equal(ours, full / 2)  # float16 rounding shows: not reduced in float32
    torch.testing.assert_close(results[0][0], flat_params(model), rtol=1e-6, atol=1e-8)


def _mesh_and_caps(rank: int, world_size: int) -> tuple[torch.Tensor, list[int]]:
    mesh = init_device_mesh("cpu", (world_size,))
    sizes: list[int] = []

    def counting_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        sizes.append(len(bucket.parameters()))
        return allreduce_hook(state, bucket)

    # Buckets, in reverse parameter order: the first holds one byte at most
    # (one parameter), the others 1 MiB (all the rest).
    model = DistributedDataParallel(make_model(), device_mesh=mesh, bucket_cap_mb_list=[1e-6, 1.0])
    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(3 + 2 * rank):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            optimizer.step()
    return flat_params(model), sizes[:2]


def test_device_mesh_and_bucket_cap_mb_list_under_join() -> None:
    results = run_ranks(_mesh_and_caps, 2)
    assert torch.equal(results[0][0], results[1][0])
    expected = reference([3, 5], lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.testing.assert_close(results[0][0], expected, rtol=1e-5, atol=1e-6)
    assert results[0][1] == results[1][1] == [1, 3]


def _scatter_gather(rank: int, world_size: int) -> tuple[list[list[int]], list[int]]:
    model = DistributedDataParallel(torch.nn.Linear(2, 2).cuda(), device_ids=[0], dim=1)
    x = torch.arange(8.0).view(2, 4).cuda()
    inputs, _ = model.scatter((x,), {}, [0])
    gathered = model.gather([x, x], 0)
    return [list(part[0].shape) for part in inputs], list(gathered.shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's scatter and gather of tensors need CUDA")
def test_scatter_and_gather_work_along_dim() -> None:
    shapes, gathered = run_ranks(_scatter_gather, 1)[0]
    assert shapes == [[2, 4]]
    assert gathered == [2, 8]  # joined along dim=1


class _ScaledSGD(torch.optim.SGD):
    """An optimizer whose step takes an argument of its own."""

    def step(self, closure: Any = None, scale: float = 1.0) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(scale)
        return super().step(closure)


def _zero_step_with_keywords(rank: int, world_size: int) -> torch.Tensor:
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), _ScaledSGD, lr=0.1)
    loss_fn(model, *batch(0, 0)).backward()
    zero.step(scale=2.0)
    return flat_params(model)


def test_zero_passes_step_keywords_to_the_local_optimizer_as_torchs() -> None:
    expected_model = make_model()
    loss_fn(expected_model, *batch(0, 0)).backward()
    torch.optim.SGD(expected_model.parameters(), lr=0.2).step()
    for result in run_ranks(_zero_step_with_keywords, 2):
        torch.testing.assert_close(result, flat_params(expected_model), rtol=1e-6, atol=1e-7)


def _overlap(rank: int, world_size: int, compressed: bool) -> list[torch.Tensor]:
    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001)  # several buckets
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.05)
    hook = fp16_compress_wrapper(allreduce_hook) if compressed else allreduce_hook
    model.register_comm_hook(None, hook_with_zero_step(hook, model, zero))
    after_backward: list[torch.Tensor] = []
    with Join([model, zero]):
        for step in range(3 + 2 * rank):
            zero.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            after_backward.append(flat_params(model))
            zero.step()
    return [flat_params(model), *after_backward]


@pytest.mark.parametrize("compressed", [False, True], ids=["allreduce_hook", "fp16_compress_wrapper"])
def test_zero_overlapped_with_ddp_steps_during_backward_under_join(compressed: bool) -> None:
    first, second = run_ranks(_overlap, 2, compressed)
    assert torch.equal(first[0], second[0])
    expected = reference([3, 5], lambda ps: torch.optim.Adam(ps, lr=0.05))
    rtol, atol = (1e-2, 1e-3) if compressed else (1e-5, 1e-6)  # float16 on the wire
    torch.testing.assert_close(first[0], expected, rtol=rtol, atol=atol)
    # The parameters had changed when backward returned: step() stepped nothing more.
    assert not torch.equal(first[1], flat_params(make_model()))
    assert torch.equal(second[-1], second[0])


def _dropped_wrappers(rank: int, world_size: int) -> tuple[bool, list[float]]:
    """Wrap a module, drop the wrapper, wrap it again and train once: whether the dropped
    wrapper was freed, and the gradient the second one averaged."""
    module = make_model()
    dropped = weakref.ref(DistributedDataParallel(module))
    gc.collect()
    model = DistributedDataParallel(module)
    loss_fn(model, *batch(rank, 0)).backward()
    return dropped() is None, [float(p.grad.sum()) for p in module.parameters() if p.grad is not None]


def test_a_dropped_wrapper_is_freed_and_leaves_no_hook_on_the_module_as_torchs() -> None:
    # Its gradient hooks held it (and its buckets, the size of the gradients) for as long as
    # the module lived: a trainer that wraps a module per fit() gathered one per run.
    (freed, grads), (_, other) = run_ranks(_dropped_wrappers, 2)
    assert freed
    assert grads == other and len(grads) == 4


class _BackwardInForward(torch.nn.Module):
    """A loss computed and backpropagated inside forward() (as Lightning's manual
    optimization does), with a layer it never reaches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Linear(4, 1)
        self.prepare: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.used(x).sum()
        self.prepare(loss)
        loss.backward()
        return loss


def _backward_in_forward(
    rank: int, world_size: int, ours: bool, static: bool = False
) -> tuple[bool, list[float]]:
    module = _BackwardInForward()
    if ours:
        model: Any = DistributedDataParallel(module, find_unused_parameters=not static, static_graph=static)
        module.prepare = model.prepare_for_backward
    else:
        model = TorchDDP(module, find_unused_parameters=True)
        module.prepare = lambda loss: model.reducer.prepare_for_backward([loss])
    for step in range(3):
        model(batch(rank, step)[0])
    assert module.used.weight.grad is not None
    return module.unused.weight.grad is None, module.used.weight.grad.reshape(-1).tolist()


@pytest.mark.parametrize("static", [False, True], ids=["find-unused", "static-graph"])
def test_prepare_for_backward_before_a_backward_inside_forward_finds_unused_parameters_as_torchs(
    static: bool,
) -> None:
    theirs = run_ranks(_backward_in_forward, 2, False)
    ours = run_ranks(_backward_in_forward, 2, True, static)
    assert theirs[0][0] and ours[0][0]
    for (_, mine), (_, torchs) in zip(ours, theirs):
        assert mine == pytest.approx(torchs, rel=1e-6)


class _TwoOutputs(torch.nn.Module):
    """torch's UnusedParamTwoLinLayerNet: two outputs, the loss may leave one out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(10, 10, bias=False)
        self.b = torch.nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _output_unused_in_loss(rank: int, world_size: int, ours: bool, hook: bool, views: bool) -> list[Any]:
    """The gradient of ``a`` after each step, as torch's DistributedDataParallel (or ours) leaves it:
    step 0 uses only ``b`` (``a``'s gradient must stay None), step 1 both outputs on every rank,
    step 2 only ``b`` (``a``'s must stay as it was), step 3 uses ``a`` on rank 0 alone (an
    average, on every rank), step 4 uses it in a no_sync pass before a step that does not (it
    arrived: averaged too)."""
    wrap = DistributedDataParallel if ours else TorchDDP
    model: Any = wrap(_TwoOutputs(), find_unused_parameters=True, gradient_as_bucket_view=views)
    if hook:
        model.register_comm_hook(None, allreduce_hook if ours else default_hooks.allreduce_hook)
    x = torch.full((4, 10), float(rank + 1))
    seen: list[Any] = []
    for step in range(5):
        if step in (3, 4):
            model.zero_grad()
        if step == 4:
            with model.no_sync():
                first, second = model(x)
                (first * second).sum().backward()
        first, second = model(x)
        uses_a = step == 1 or (step == 3 and rank == 0)
        ((first * second).sum() if uses_a else second.sum()).backward()
        grad = model.module.a.weight.grad
        seen.append(None if grad is None else grad.clone())
    return seen


@pytest.mark.parametrize("hook", [False, True], ids=["builtin", "comm-hook"])
@pytest.mark.parametrize("views", [False, True], ids=["copies", "bucket-views"])
def test_a_parameter_whose_output_the_loss_leaves_out_keeps_its_gradient_as_torchs(
    hook: bool, views: bool
) -> None:
    # Its output was reached by the forward, so its gradient was "used": zeros were averaged
    # into it (step 0), where torch counts the gradients that arrive and leaves it alone.
    ours = run_ranks(_output_unused_in_loss, 2, True, hook, views)
    theirs = run_ranks(_output_unused_in_loss, 2, False, hook, views)
    for rank in range(2):
        for step, (mine, torchs) in enumerate(zip(ours[rank], theirs[rank])):
            assert (mine is None) == (torchs is None), f"rank {rank} step {step}"
            if mine is not None:
                torch.testing.assert_close(mine, torchs, msg=f"rank {rank} step {step}")
    assert ours[0][0] is None
    assert ours[0][2] is not None and torch.equal(ours[0][2], ours[0][1])  # left as it was


def _undefined_gradients(rank: int, world_size: int) -> list[bool]:
    model = DistributedDataParallel(_TwoOutputs(), find_unused_parameters=True)
    first, second = model(torch.ones(2, 10))
    torch._C._functions.UndefinedGrad()((first * second).sum()).backward()  # type: ignore[attr-defined]
    return [param.grad is None for param in model.parameters()]


def test_undefined_gradients_leave_grad_none_as_torchs() -> None:
    # The hooks ran for them with .grad None: counted as arrived, the parameters got zeros.
    assert run_ranks(_undefined_gradients, 2) == [[True, True]] * 2


class _SecondLayerSometimes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(4, 4, bias=False)
        self.second = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor, second: bool) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        return self.second(hidden) if second else hidden


def _graph_changing_under_static_graph(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(_SecondLayerSometimes(), static_graph=True)
    model(torch.full((3, 4), float(rank + 1)), False).sum().backward()  # learned: no gradient for `second`
    with pytest.raises(RuntimeError) as changed:
        model(torch.full((3, 4), float(rank + 1)), True).sum().backward()
    return str(changed.value)


def test_a_parameter_used_after_a_static_graph_learned_it_unused_raises_as_torchs() -> None:
    # Its gradient was left as each rank's own, unaveraged: the replicas drifted apart silently.
    for message in run_ranks(_graph_changing_under_static_graph, 2):
        assert message.startswith("Your training graph has changed in this iteration"), message
        assert "parameter 1 (shape (4, 4)) got a gradient more than the 0 time(s)" in message, message
