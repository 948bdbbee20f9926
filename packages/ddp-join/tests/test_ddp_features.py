"""no_sync, communication hooks, buffers, unused parameters and the ZeRO
state dict, each under uneven inputs: no hang, every rank identical."""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_cases import DEVICES, batch, flat_params, loss_fn, make_model, rank_device, reference

from ddp_join import (
    DistributedDataParallel,
    GradBucket,
    ZeroRedundancyOptimizer,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from join_core import Join
from join_core.testing import run_ranks


def _no_sync(rank: int, world_size: int, device: str, backend: str) -> torch.Tensor:
    dev = rank_device(device, backend, rank)
    model = DistributedDataParallel(make_model().to(dev), device_ids=[dev] if dev.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(4 + 2 * rank):
            if step % 2 == 0:
                optimizer.zero_grad()
                with model.no_sync():
                    loss_fn(model, *batch(rank, step, dev)).backward()
            else:
                loss_fn(model, *batch(rank, step, dev)).backward()
                optimizer.step()
    return flat_params(model)


@DEVICES
def test_no_sync_every_other_step_under_join(device: str, backend: str) -> None:
    results = run_ranks(_no_sync, 3, device, backend, backend=backend)
    assert all(torch.equal(results[0], r) for r in results[1:])
    # Reference: pairs of steps accumulate, then the sum over active ranks / W.
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = [4, 6, 8]
    for pair in range(4):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in (r for r in range(3) if counts[r] > 2 * pair):
            model.zero_grad()
            for step in (2 * pair, 2 * pair + 1):
                loss_fn(model, *batch(rank, step)).backward()
            for acc, p in zip(total, model.parameters()):
                assert p.grad is not None
                acc += p.grad
        for acc, p in zip(total, model.parameters()):
            p.grad = acc / 3
        optimizer.step()
    torch.testing.assert_close(results[0], flat_params(model), rtol=1e-5, atol=1e-6)


def _sum_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A user's hook written as for torch: average over the group size."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    fut: torch.futures.Future[list[torch.Tensor]] = dist.all_reduce(tensor, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _per_gradient_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduces through ``bucket.gradients()``, one all-reduce per parameter."""
    for grad, param in zip(bucket.gradients(), bucket.parameters()):
        assert grad.shape == param.shape
        dist.all_reduce(grad.div_(bucket.divisor()))
    return _done(bucket.buffer())


def _packed_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Written for torch's buffer, which has no padding: returns the gradients packed."""
    packed = torch.cat([grad.reshape(-1) for grad in bucket.gradients()]).div_(dist.get_world_size())
    fut: torch.futures.Future[list[torch.Tensor]] = dist.all_reduce(packed, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


HOOKS = {
    "allreduce_hook": allreduce_hook,
    "fp16_compress_hook": fp16_compress_hook,
    "bf16_compress_hook": bf16_compress_hook,
    # torch's wrappers replace the bucket's buffer (GradBucket.set_buffer) by a compressed copy.
    "fp16_compress_wrapper(allreduce_hook)": fp16_compress_wrapper(allreduce_hook),
    "bf16_compress_wrapper(custom)": bf16_compress_wrapper(_sum_hook),
    "custom": _sum_hook,
    "per_gradient": _per_gradient_hook,
    "packed": _packed_hook,
}


def _with_hook(rank: int, world_size: int, device: str, backend: str, hook_name: str) -> torch.Tensor:
    dev = rank_device(device, backend, rank)
    # One parameter per bucket, except for the hooks that read a bucket's gradients one by one.
    cap = 25.0 if hook_name in ("per_gradient", "packed") else 0.0001
    model = DistributedDataParallel(
        make_model().to(dev), device_ids=[dev] if dev.type == "cuda" else None, bucket_cap_mb=cap
    )
    model.register_comm_hook(None, HOOKS[hook_name])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(3 + 2 * rank):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step, dev)).backward()
            optimizer.step()
    return flat_params(model)


@DEVICES
@pytest.mark.parametrize("hook_name", sorted(HOOKS))
def test_comm_hook_under_join(device: str, backend: str, hook_name: str) -> None:
    results = run_ranks(_with_hook, 3, device, backend, hook_name, backend=backend)
    assert all(torch.equal(results[0], r) for r in results[1:])
    expected = reference([3, 5, 7], lambda ps: torch.optim.SGD(ps, lr=0.1))
    # float16 or bfloat16 on the wire
    rtol, atol = (
        (5e-2, 5e-3) if "bf16" in hook_name else (1e-2, 1e-3) if "fp16" in hook_name else (1e-5, 1e-6)
    )
    torch.testing.assert_close(results[0], expected, rtol=rtol, atol=atol)


def _early_write(rank: int, world_size: int) -> tuple[bool, torch.Tensor]:
    """Whether bucket 0's gradients were written while bucket 1 was still being reduced."""
    model = DistributedDataParallel(make_model(), bucket_cap_mb_list=[1e-6, 1.0])
    first = list(model.parameters())[-1]  # bucket 0 holds the last parameter alone
    seen: list[bool] = []

    def held_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        reduced = allreduce_hook(state, bucket)
        if bucket.index() == 0:
            return reduced
        assert first.grad is not None
        local = first.grad.clone()
        held: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def written() -> bool:
            grad = first.grad
            return grad is not None and not torch.equal(grad, local)

        def release() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not written():
                time.sleep(0.001)
            seen.append(written())
            held.set_result(reduced.wait())

        threading.Thread(target=release).start()
        return held

    model.register_comm_hook(None, held_hook)
    loss_fn(model, *batch(rank, 0)).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return seen == [True], grads


def test_a_bucket_s_gradients_are_written_while_later_buckets_are_reduced() -> None:
    results = run_ranks(_early_write, 2)
    assert [early for early, _ in results] == [True, True]
    assert torch.equal(results[0][1], results[1][1])


class _BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.norm(self.linear(x)))
        return out


def _batch_norm(rank: int, world_size: int, device: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    dev = rank_device(device, backend, rank)
    model = DistributedDataParallel(_BatchNormNet().to(dev), device_ids=[dev] if dev.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(2 + 3 * rank):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step, dev)).backward()
            optimizer.step()
    buffers = torch.cat([b.reshape(-1).double().cpu() for b in model.module.buffers()])
    return flat_params(model), buffers


@DEVICES
def test_batch_norm_buffers_stay_in_sync_under_join(device: str, backend: str) -> None:
    results = run_ranks(_batch_norm, 3, device, backend, backend=backend)
    for params, buffers in results[1:]:
        assert torch.equal(results[0][0], params)
        assert torch.equal(results[0][1], buffers)
    # The last joiner trained 8 steps: num_batches_tracked says so everywhere.
    assert int(results[0][1][-1]) == 8


class _PartlyUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 2)
        self.sometimes = torch.nn.Linear(4, 2)
        self.never = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_sometimes: bool) -> torch.Tensor:
        out: torch.Tensor = self.used(x)
        return out + self.sometimes(x) if use_sometimes else out


def _unused(rank: int, world_size: int, device: str, backend: str) -> tuple[torch.Tensor, bool]:
    dev = rank_device(device, backend, rank)
    model = DistributedDataParallel(
        _PartlyUsed().to(dev), device_ids=[dev] if dev.type == "cuda" else None, find_unused_parameters=True
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(2 + 2 * rank):
            optimizer.zero_grad(set_to_none=True)
            x, y = batch(rank, step, dev)
            torch.nn.functional.mse_loss(model(x, use_sometimes=(rank + step) % 2 == 0), y).backward()
            optimizer.step()
    return flat_params(model), model.module.never.weight.grad is None


@DEVICES
def test_unused_parameters_under_join(device: str, backend: str) -> None:
    results = run_ranks(_unused, 3, device, backend, backend=backend)
    assert all(torch.equal(results[0][0], r[0]) for r in results[1:])
    # No rank ever used it: its gradient stays None everywhere.
    assert all(never_grad_is_none for _, never_grad_is_none in results)


def _refuse_to_unpickle(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("consolidate_state_dict unpickled what a peer sent")


def _zero_state(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    model = DistributedDataParallel(make_model())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    for step in range(2):
        optimizer.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        optimizer.step()
    real_loads = pickle.loads
    pickle.loads = _refuse_to_unpickle  # nothing that came from a peer is unpickled
    try:
        optimizer.consolidate_state_dict(to=0)
    finally:
        pickle.loads = real_loads
    state = optimizer.state_dict() if rank == 0 else None
    if state is not None:
        # This rank's own shard comes back bit for bit.
        index = {id(p): i for i, p in enumerate(model.parameters())}
        for param, local in optimizer.optim.state.items():
            for key, value in local.items():
                assert torch.equal(state["state"][index[id(param)]][key], value), key
    # Load the consolidated state into a fresh ZeRO and a plain Adam.
    path = f"{tmp}/zero.pt"
    if rank == 0:
        torch.save(state, path)
    dist.barrier()
    saved = torch.load(path)
    fresh = ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.Adam, lr=0.5)
    fresh.load_state_dict(saved)
    plain = torch.optim.Adam(make_model().parameters(), lr=0.5)
    plain.load_state_dict(saved)
    error = ""
    if rank == 1:
        try:
            optimizer.state_dict()
        except RuntimeError as e:
            error = str(e)
    return {
        "num_states": len(saved["state"]),
        "lr": (fresh.param_groups[0]["lr"], plain.param_groups[0]["lr"]),
        "local_steps": sorted(float(s["step"]) for s in fresh.optim.state.values()),
        "error": error,
    }


def test_zero_state_dict_round_trip(tmp_path: Path) -> None:
    first, second = run_ranks(_zero_state, 2, str(tmp_path))
    assert first["num_states"] == len(list(make_model().parameters()))
    assert first["lr"] == second["lr"] == (0.01, 0.01)
    assert first["local_steps"] and all(s == 2.0 for s in first["local_steps"] + second["local_steps"])
    assert "call consolidate_state_dict(to=1) on every rank first" in second["error"]


def _add_group(rank: int, world_size: int) -> torch.Tensor:
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    optimizer = ZeroRedundancyOptimizer(first.parameters(), torch.optim.SGD, lr=0.1)
    optimizer.add_param_group({"params": list(second.parameters()), "lr": 0.2})
    x = torch.ones(2, 4) * (rank + 1)
    second(first(x)).sum().backward()
    optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in [*first.parameters(), *second.parameters()]])


def test_zero_add_param_group_shards_and_steps_the_new_group() -> None:
    results = run_ranks(_add_group, 2)
    # Each rank stepped its own shard with its own gradient; after the
    # broadcast every rank holds the same parameters.
    assert torch.equal(results[0], results[1])


def _errors(rank: int, world_size: int) -> list[str]:
    messages = []
    for make in (
        lambda: DistributedDataParallel(torch.nn.Linear(2, 2), device_ids=[0]),
        lambda: DistributedDataParallel(torch.nn.ReLU()),
        lambda: DistributedDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=0),
    ):
        try:
            make()
        except ValueError as error:
            messages.append(str(error))
        except RuntimeError as error:  # torch's type for a module without trainable parameters
            messages.append(f"RuntimeError: {error}")
    model = DistributedDataParallel(torch.nn.Linear(2, 2))
    model.register_comm_hook(None, allreduce_hook)
    try:
        model.register_comm_hook(None, allreduce_hook)
    except RuntimeError as error:
        messages.append(str(error))
    with Join([model]):
        pass
    return messages


def test_bad_arguments_name_the_argument_and_the_fix() -> None:
    messages = run_ranks(_errors, 2)[0]
    assert "device_ids=[0]): must be None for a module on the CPU" in messages[0]
    assert messages[1] == (
        "RuntimeError: DistributedDataParallel is not needed when a module doesn't have any parameter that "
        "requires a gradient: there is nothing to synchronize"
    )
    assert "bucket_cap_mb=0): must be positive" in messages[2]
    assert "a hook is already registered" in messages[3]


def _different_models(rank: int, world_size: int) -> list[str]:
    messages = []
    for model in (
        torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(1 + (rank == 1))]),  # more layers
        torch.nn.Linear(2, 2 + (rank == 2)),  # the same count, another shape
    ):
        with pytest.raises(RuntimeError) as refused:
            DistributedDataParallel(model)
        messages.append(str(refused.value))
    DistributedDataParallel(torch.nn.Linear(2, 2))  # the group still works
    return messages


def test_ranks_with_different_models_are_refused_on_every_rank_as_torchs() -> None:
    # Rank 1's second layer was broadcast over rank 0's bias and weight, then trained apart.
    results = run_ranks(_different_models, 3)
    assert all(messages == results[0] for messages in results)
    more_layers, other_shape = results[0]
    assert more_layers.startswith(
        "DDP expects same model across all ranks, but rank(s) [1] hold parameters and buffers of other "
        "shapes or dtypes than rank 0 (rank 0: 2, rank 1: 4 tensors)"
    )
    assert "but rank(s) [2] hold" in other_shape and "(rank 0: 2, rank 2: 2 tensors)" in other_shape


def test_construction_needs_an_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"call torch\.distributed\.init_process_group"):
        DistributedDataParallel(torch.nn.Linear(2, 2))


def _complex_grads(rank: int, world_size: int, join: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 2, dtype=torch.cfloat))
    x = torch.randn(4, 3, dtype=torch.cfloat, generator=torch.Generator().manual_seed(rank))
    with Join([model], enable=join):
        model(x).abs().sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("join", [False, True], ids=["plain", "under-join"])
def test_complex_parameters_average_as_torch_does(join: bool) -> None:
    per_rank = run_ranks(_complex_grads, 2, join)
    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 2, dtype=torch.cfloat)
    for rank in range(2):
        x = torch.randn(4, 3, dtype=torch.cfloat, generator=torch.Generator().manual_seed(rank))
        (plain(x).abs().sum() / 2).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in plain.parameters() if p.grad is not None])
    for grads in per_rank:
        torch.testing.assert_close(grads, expected)
