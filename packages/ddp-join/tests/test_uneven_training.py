"""DistributedDataParallel and ZeroRedundancyOptimizer with uneven inputs:
every rank ends identical, and equal to a single-process reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ddp_cases import DEVICES, batch, flat_params, loss_fn, make_model, rank_device, reference

from ddp_join import DistributedDataParallel, ZeroRedundancyOptimizer
from join_core import Join, ShadowCollectives
from join_core.testing import run_ranks

BASE, EXTRA = 3, 2  # rank r trains on BASE + r * EXTRA batches


def counts(world_size: int) -> list[int]:
    return [BASE + r * EXTRA for r in range(world_size)]


def _train_sgd(
    rank: int, world_size: int, device: str, backend: str, divide: bool, bucket_view: bool
) -> torch.Tensor:
    dev = rank_device(device, backend, rank)
    model = DistributedDataParallel(
        make_model().to(dev),
        device_ids=[dev] if dev.type == "cuda" else None,
        bucket_cap_mb=0.0001,  # several buckets
        gradient_as_bucket_view=bucket_view,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join(divide_by_initial_world_size=divide):
        for step in range(counts(world_size)[rank]):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step, dev)).backward()
            optimizer.step()
    return flat_params(model)


@DEVICES
@pytest.mark.parametrize("divide", [True, False], ids=["divide-by-world", "divide-by-active"])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["grad-copy", "grad-as-bucket-view"])
def test_uneven_sgd_matches_single_process_reference(
    device: str, backend: str, divide: bool, bucket_view: bool
) -> None:
    world_size = 3
    results = run_ranks(_train_sgd, world_size, device, backend, divide, bucket_view, backend=backend)
    for other in results[1:]:
        assert torch.equal(results[0], other)
    expected = reference(counts(world_size), lambda ps: torch.optim.SGD(ps, lr=0.1), divide)
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-6)


def _train_zero(
    rank: int, world_size: int, device: str, backend: str, optimizer_name: str, bucket_view: bool
) -> torch.Tensor:
    dev = rank_device(device, backend, rank)
    model = DistributedDataParallel(make_model().to(dev), device_ids=[dev] if dev.type == "cuda" else None)
    optimizer_class: type[torch.optim.Optimizer] = getattr(torch.optim, optimizer_name)
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class, parameters_as_bucket_view=bucket_view, lr=0.05
    )
    with Join([model, optimizer]):
        for step in range(counts(world_size)[rank]):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step, dev)).backward()
            optimizer.step()
    return flat_params(model)


@DEVICES
@pytest.mark.parametrize("optimizer_name", ["SGD", "Adam"])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["params-copied", "params-as-bucket-view"])
def test_zero_under_join_matches_reference_of_same_optimizer(
    device: str, backend: str, optimizer_name: str, bucket_view: bool
) -> None:
    world_size = 3
    results = run_ranks(
        _train_zero, world_size, device, backend, optimizer_name, bucket_view, backend=backend
    )
    for other in results[1:]:
        assert torch.equal(results[0], other)
    optimizer_class: Any = getattr(torch.optim, optimizer_name)
    expected = reference(counts(world_size), lambda ps: optimizer_class(ps, lr=0.05))
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-6)


class _GradRecorder:
    """A Joinable after the model: records the gradients each rank holds
    after every iteration, shadowed ones included."""

    def __init__(self, model: DistributedDataParallel[Any]) -> None:
        self.model = model
        self.grads: list[torch.Tensor] = []

    def record(self) -> None:
        self.grads.append(
            torch.cat([p.grad.reshape(-1).clone() for p in self.model.parameters() if p.grad is not None])
        )

    def join_hook(self, **kwargs: Any) -> Any:
        from join_core import JoinHook

        recorder = self

        class Hook(JoinHook):
            def main_hook(self) -> None:
                recorder.record()

        return Hook()

    @property
    def join_device(self) -> torch.device:
        return self.model.join_device

    @property
    def join_process_group(self) -> Any:
        return self.model.join_process_group


def _joined_grads(rank: int, world_size: int, views: bool) -> list[torch.Tensor]:
    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001, gradient_as_bucket_view=views)
    recorder = _GradRecorder(model)
    with Join([model, recorder]):
        for step in range(2 + 2 * rank):
            model.zero_grad(set_to_none=not views)
            loss_fn(model, *batch(rank, step)).backward()
            recorder.record()
    return recorder.grads


@pytest.mark.parametrize("views", [False, True], ids=["grad-copies", "grad-bucket-views"])
def test_joined_rank_receives_the_reduced_gradients(views: bool) -> None:
    early, late = run_ranks(_joined_grads, 2, views)
    assert len(early) == len(late) == 4
    for shadowed, trained in zip(early, late):
        assert torch.equal(shadowed, trained)


def _grads_kept_while_shadowing(rank: int, world_size: int, shadow_collectives: bool, views: bool) -> bool:
    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001, gradient_as_bucket_view=views)
    joinables: list[Any] = [model, ShadowCollectives()] if shadow_collectives else [model]
    with Join(joinables):
        for step in range(2 + 2 * rank):
            model.zero_grad(set_to_none=not views)
            loss_fn(model, *batch(rank, step)).backward()
            last_step = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    after = [p.grad for p in model.parameters() if p.grad is not None]
    return all(torch.equal(kept, now) for kept, now in zip(last_step, after, strict=True))


@pytest.mark.parametrize("views", [False, True], ids=["grad-copies", "grad-bucket-views"])
@pytest.mark.parametrize("shadow_collectives", [False, True], ids=["alone", "with-shadow-collectives"])
def test_a_joined_rank_with_nothing_to_read_its_gradients_keeps_them_as_its_last_step_left_them(
    shadow_collectives: bool, views: bool
) -> None:
    # Nothing on the joined rank reads them before the Join ends (as with torch): the copy of each
    # shadowed iteration's gradients is skipped, and gradient views are not the buffers a joined
    # rank reduces its zeros in. Every rank ends the Join with the gradients of its own last step.
    early, late = run_ranks(_grads_kept_while_shadowing, 2, shadow_collectives, views)
    assert early and late


def _even(rank: int, world_size: int, enable: bool) -> torch.Tensor:
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join(enable=enable):
        for step in range(4):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            optimizer.step()
    return flat_params(model)


@pytest.mark.parametrize("enable", [True, False], ids=["join-enabled", "join-disabled"])
def test_even_inputs_train_like_plain_data_parallel(enable: bool) -> None:
    results = run_ranks(_even, 2, enable)
    assert torch.equal(results[0], results[1])
    expected = reference([4, 4], lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=1e-6)


def _throw(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(make_model())
    try:
        with model.join(throw_on_early_termination=True):
            for step in range(3 + 3 * rank):
                loss_fn(model, *batch(rank, step)).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_early_termination_raises_on_every_rank() -> None:
    messages = run_ranks(_throw, 3)
    assert messages[0] == "Rank 0 exhausted all inputs."
    assert (
        messages[1:] == ["Detected at least one rank that exhausted inputs. Throwing across all ranks."] * 2
    )


def _fail(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(make_model())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    try:
        with Join([model, optimizer]):
            for step in range(5):
                loss = loss_fn(model, *batch(rank, step))
                if rank == 1 and step == 2:
                    raise ValueError("bad batch")  # after forward, before backward
                loss.backward()
                optimizer.step()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_failing_rank_aborts_every_rank() -> None:
    messages = run_ranks(_fail, 3, timeout=60)
    assert messages[1] == "ValueError: bad batch"
    assert messages[0] == messages[2] == "JoinAbortedError: Join aborted: rank 1 raised ValueError: bad batch"


def _count_collectives(rank: int, world_size: int, joined: bool) -> int:
    from torch.profiler import ProfilerActivity, profile

    model = DistributedDataParallel(make_model(), bucket_cap_mb=0.0001)
    steps = 5
    with model.join(enable=joined):
        loss_fn(model, *batch(rank, 0)).backward()  # warm-up, outside the count
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(1, steps + 1):
                loss_fn(model, *batch(rank, step)).backward()
    return sum(1 for event in prof.events() if event.name.startswith("gloo:"))


def test_join_adds_no_collective_to_a_healthy_iteration() -> None:
    without = run_ranks(_count_collectives, 2, False)
    with_join = run_ranks(_count_collectives, 2, True)
    assert without == with_join
    assert without[0] > 0
