"""ShadowCollectives with DistributedDataParallel and ZeroRedundancyOptimizer:
a layer that syncs statistics in forward and backward, and a metric synced in
the loop, under uneven inputs; every rank ends equal to a single-process
reference whose statistics cover the union of the active ranks' batches."""

from __future__ import annotations

import time
from typing import Any

import ddp_cases
import pytest
import torch
import torch.distributed as dist
from ddp_cases import flat_params

from ddp_join import DistributedDataParallel, GradBucket, ZeroRedundancyOptimizer, allreduce_hook
from join_core import CollectiveMismatchError, Join, ShadowCollectives
from join_core.testing import run_ranks

BASE, EXTRA = 3, 2  # rank r trains on BASE + r * EXTRA batches
#: Wide enough that the output layer fills DDP's first bucket alone, so the
#: layer's backward all-reduce is issued between two buckets.
OUT = 32768


def optimizer_options(name: str) -> dict[str, Any]:
    # Adam's default eps turns the float32 rounding noise of near-zero
    # gradients (sums taken in another order than the reference's) into
    # full-size steps; a larger one keeps the comparison about the collectives.
    return {"lr": 0.05, "eps": 1e-4} if name == "Adam" else {"lr": 0.05}


def counts(world_size: int) -> list[int]:
    return [BASE + r * EXTRA for r in range(world_size)]


class _SyncNormFunction(torch.autograd.Function):
    """Batch normalization over the union of the ranks' batches: one all-reduce
    of the statistics in forward, one of the gradient sums in backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, distributed: bool
    ) -> torch.Tensor:
        count = torch.full((x.shape[1],), float(x.shape[0]))
        stats = torch.stack([x.sum(0), (x * x).sum(0), count])
        if distributed:
            dist.all_reduce(stats)
        total, mean = stats[2], stats[0] / stats[2]
        invstd = torch.rsqrt(stats[1] / total - mean * mean + 1e-5)
        xhat = (x - mean) * invstd
        ctx.distributed = distributed
        ctx.save_for_backward(xhat, invstd, weight, total)
        return xhat * weight + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        xhat, invstd, weight, total = ctx.saved_tensors
        dxhat = dy * weight
        sums = torch.stack([dxhat.sum(0), (dxhat * xhat).sum(0)])
        if ctx.distributed:
            dist.all_reduce(sums)
        dx = invstd / total * (total * dxhat - sums[0] - xhat * sums[1])
        return dx, (dy * xhat).sum(0), dy.sum(0), None


class SyncNorm(torch.nn.Module):
    """The CPU stand-in for SyncBatchNorm, with a running mean that DDP broadcasts."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(features))
        self.bias = torch.nn.Parameter(torch.zeros(features))
        self.register_buffer("running_mean", torch.zeros(features))
        self.distributed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _SyncNormFunction.apply(  # type: ignore[no-untyped-call]
            x, self.weight, self.bias, self.distributed
        )
        return out


def make_model(norm: str = "sync") -> torch.nn.Module:
    torch.manual_seed(0)
    layer: torch.nn.Module = SyncNorm(8) if norm == "sync" else torch.nn.BatchNorm1d(8)
    # No bias before the normalization: it cancels out, and Adam would amplify its noise.
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8, bias=False), layer, torch.nn.Tanh(), torch.nn.Linear(8, OUT)
    )


def batch(rank: int, step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 4, generator=gen).to(device), torch.randn(5, OUT, generator=gen).to(device)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def reference(world_size: int, optimizer_name: str, norm: str = "sync") -> tuple[torch.Tensor, list[float]]:
    """One process: at iteration i, the model runs on the union of the active
    ranks' batches (so the statistics cover it); the gradient is that of the
    sum of the active ranks' losses over the world size, as DDP averages.
    Returns the parameters and, per iteration, the sum of the active ranks' losses."""
    model = make_model(norm)
    for layer in model.modules():
        if isinstance(layer, SyncNorm):
            layer.distributed = False
    optimizer: torch.optim.Optimizer = getattr(torch.optim, optimizer_name)(
        model.parameters(), **optimizer_options(optimizer_name)
    )
    sums = []
    for step in range(max(counts(world_size))):
        active = [r for r in range(world_size) if counts(world_size)[r] > step]
        parts = [batch(r, step) for r in active]
        out = model(torch.cat([x for x, _ in parts]))
        losses = [
            torch.nn.functional.mse_loss(piece, y) for piece, (_, y) in zip(out.split(5), parts, strict=True)
        ]
        optimizer.zero_grad()
        (torch.stack(losses).sum() / world_size).backward()
        optimizer.step()
        sums.append(float(sum(loss.item() for loss in losses)))
    return flat_params(model), sums


def _own_allreduce_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    # Not the built-in reduction, so the heartbeat cannot ride in the first bucket.
    return allreduce_hook(state, bucket)


def _train(
    rank: int,
    world_size: int,
    metric: bool,
    optimizer_name: str,
    zero: bool,
    norm: str,
    device: str,
    separate_heartbeat: bool = False,
) -> tuple[torch.Tensor, list[float]]:
    dev = torch.device(device if device == "cpu" else f"cuda:{rank if dist.get_backend() == 'nccl' else 0}")
    module = make_model(norm).to(dev)
    if norm == "torch-sync":
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    model = DistributedDataParallel(
        module, device_ids=[dev] if dev.type == "cuda" else None, bucket_cap_mb=0.0001
    )
    if separate_heartbeat:
        model.register_comm_hook(None, _own_allreduce_hook)
    optimizer_class: type[torch.optim.Optimizer] = getattr(torch.optim, optimizer_name)
    optimizer: torch.optim.Optimizer = (
        ZeroRedundancyOptimizer(model.parameters(), optimizer_class, **optimizer_options(optimizer_name))
        if zero
        else optimizer_class(model.parameters(), **optimizer_options(optimizer_name))
    )
    joinables: list[Any] = [model, optimizer] if zero else [model]
    sums = []
    with Join([*joinables, ShadowCollectives()]):
        for step in range(counts(world_size)[rank]):
            optimizer.zero_grad()
            loss = _loss(model, *batch(rank, step, dev))
            loss.backward()
            optimizer.step()
            if metric:
                synced = loss.detach().clone()
                dist.all_reduce(synced)
                sums.append(synced.item())
    return flat_params(model), sums


def _check(
    results: list[tuple[torch.Tensor, list[float]]], optimizer_name: str, metric: bool, norm: str
) -> None:
    world_size = len(results)
    expected, expected_sums = reference(world_size, optimizer_name, "sync" if norm == "sync" else "torch")
    # Adam divides by the root of tiny second moments: a few of its parameters
    # move by a few 1e-6 for summation order alone (plain Adam does the same).
    atol = 1e-5 if optimizer_name == "Adam" else 1e-6
    for rank, (params, sums) in enumerate(results):
        torch.testing.assert_close(params, expected, rtol=1e-5, atol=atol)
        if metric:
            assert len(sums) == counts(world_size)[rank]
            torch.testing.assert_close(sums, expected_sums[: len(sums)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 4])
def test_layer_syncing_statistics_in_forward_matches_union_reference(world_size: int) -> None:
    results = run_ranks(_train, world_size, False, "SGD", False, "sync", "cpu", timeout=240)
    _check(results, "SGD", False, "sync")


@pytest.mark.parametrize("separate", [False, True], ids=["heartbeat-carried", "heartbeat-all-reduce"])
def test_metric_all_reduced_in_the_loop_sums_the_active_ranks(separate: bool) -> None:
    results = run_ranks(_train, 3, True, "SGD", False, "sync", "cpu", separate, timeout=240)
    _check(results, "SGD", True, "sync")


@pytest.mark.parametrize("optimizer_name", ["SGD", "Adam"])
def test_composes_with_zero_redundancy_optimizer(optimizer_name: str) -> None:
    results = run_ranks(_train, 3, True, optimizer_name, True, "sync", "cpu", timeout=240)
    _check(results, optimizer_name, True, "sync")


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            "gloo",
            id="cuda-gloo",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="SyncBatchNorm needs a CUDA device"
            ),
        ),
        pytest.param(
            "nccl",
            id="cuda-nccl",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices"),
        ),
    ],
)
def test_torch_sync_batch_norm_on_cuda_matches_union_reference(backend: str) -> None:
    results = run_ranks(_train, 2, True, "SGD", False, "torch-sync", "cuda", backend=backend, timeout=240)
    _check(results, "SGD", True, "torch-sync")


def _extra_every_third(rank: int, world_size: int) -> tuple[str, float]:
    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = time.monotonic()
    try:
        with Join([model, ShadowCollectives()]):
            for step in range(counts(world_size)[rank]):
                optimizer.zero_grad()
                loss = _loss(model, *batch(rank, step))
                loss.backward()
                optimizer.step()
                dist.all_reduce(loss.detach().clone())
                if step % 3 == 2:
                    dist.all_reduce(torch.zeros(3))  # e.g. an evaluation every third step
    except CollectiveMismatchError as error:
        return str(error), time.monotonic() - start
    return "", time.monotonic() - start


def test_sequence_changing_between_iterations_raises_on_every_rank_within_30s() -> None:
    for message, elapsed in run_ranks(_extra_every_third, 3, timeout=120):
        assert "differ" in message
        assert "all_reduce of 3 float32 elements" in message
        assert elapsed < 30


def _rank_without_batches(rank: int, world_size: int, metric: bool) -> tuple[torch.Tensor, str]:
    model = DistributedDataParallel(ddp_cases.make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Join([model, ShadowCollectives()]):
            for step in range(0 if rank == 0 else 3):
                optimizer.zero_grad()
                loss = ddp_cases.loss_fn(model, *ddp_cases.batch(rank, step))
                loss.backward()
                optimizer.step()
                if metric:
                    dist.all_reduce(loss.detach().clone())
    except CollectiveMismatchError as error:
        return flat_params(model), str(error)
    return flat_params(model), ""


def test_rank_without_batches_shadows_the_joinables_collectives() -> None:
    results = run_ranks(_rank_without_batches, 3, False, timeout=120)
    expected = ddp_cases.reference([0, 3, 3], lambda ps: torch.optim.SGD(ps, lr=0.1))
    for params, message in results:
        assert message == ""
        torch.testing.assert_close(params, expected, rtol=1e-5, atol=1e-6)


def test_rank_without_batches_cannot_shadow_a_metric_and_every_rank_says_so() -> None:
    for _, message in run_ranks(_rank_without_batches, 3, True, timeout=120):
        assert "rank 0 (joined)" in message and "having recorded no iteration before joining" in message


def _fails(rank: int, world_size: int, where: str, failing: int, at: int) -> tuple[str, float]:
    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = time.monotonic()
    try:
        with Join([model, ShadowCollectives()]):
            for step in range(counts(world_size)[rank]):
                if (rank, step, where) == (failing, at, "between-iterations"):
                    raise ValueError("failed between iterations")
                optimizer.zero_grad()
                out = model(batch(rank, step)[0])  # the layer all-reduced its statistics
                if (rank, step, where) == (failing, at, "after-forward"):
                    raise ValueError("failed after forward")
                torch.nn.functional.mse_loss(out, batch(rank, step)[1]).backward()
                optimizer.step()
                dist.all_reduce(torch.ones(1))
    except Exception as error:  # noqa: BLE001 - the test reports every rank's error
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    return "", time.monotonic() - start


@pytest.mark.parametrize("where", ["between-iterations", "after-forward"])
@pytest.mark.parametrize(
    "failing,at",
    [(1, 2), (2, 5)],
    ids=["all-training", "others-joined"],  # ranks 0 and 1 have joined by step 5 of rank 2
)
def test_failure_with_collectives_no_joinable_owns_reaches_every_rank(
    where: str, failing: int, at: int
) -> None:
    results = run_ranks(_fails, 3, where, failing, at, timeout=120)
    for rank, (message, elapsed) in enumerate(results):
        if rank == failing:
            assert message.startswith("ValueError: failed")
        else:
            assert message.startswith("JoinAbortedError") and f"rank {failing} raised ValueError" in message
        assert elapsed < 30
