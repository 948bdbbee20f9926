"""ZeroRedundancyOptimizer behaves as torch's where a user relies on it:
running values in parameter groups, one-rank groups, state-dict loading,
refused calls and attributes."""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_cases import batch, flat_params, loss_fn, make_model, reference

from ddp_join import DistributedDataParallel, ZeroRedundancyOptimizer
from join_core import Join
from join_core.testing import RanksFailedError, run_ranks

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torch.distributed.optim scripts with torch.jit
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero


class _Counting(torch.optim.Optimizer):
    """Keeps a running count in its parameter groups, as Prodigy and
    schedule-free optimizers do; each step moves by ``lr * count``."""

    def __init__(self, params: Any, lr: float = 0.1, k: int = 0) -> None:
        super().__init__(params, {"lr": lr, "k": k})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["k"] += 1
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"] * group["k"])


def _three_steps(zero_class: type[TorchZero | ZeroRedundancyOptimizer]) -> tuple[torch.Tensor, int, int]:
    model = make_model()
    zero = zero_class(model.parameters(), _Counting, lr=0.1)
    for step in range(3):
        zero.zero_grad()
        loss_fn(model, *batch(0, step)).backward()
        zero.step()
    zero.consolidate_state_dict(to=0)
    saved = zero.state_dict()["param_groups"][0]["k"] if dist.get_rank() == 0 else -1
    return flat_params(model), zero.param_groups[0]["k"], saved


def _group_values_kept(rank: int, world_size: int) -> tuple[tuple[torch.Tensor, int, int], ...]:
    return _three_steps(TorchZero), _three_steps(ZeroRedundancyOptimizer)


def test_values_the_optimizer_keeps_in_its_groups_carry_over_steps_and_into_the_state_dict() -> None:
    for rank, (theirs, ours) in enumerate(run_ranks(_group_values_kept, 2)):
        torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
        assert theirs[1] == ours[1] == 3
        assert theirs[2] == ours[2] == (3 if rank == 0 else -1)  # the saved count, on rank 0


def _one_rank_step(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    results = []
    for make_zero in (
        lambda params: TorchZero(params, torch.optim.SGD, lr=0.1),
        lambda params: ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, shard_replicas=1),
    ):
        model = make_model()
        zero = make_zero(model.parameters())
        loss_fn(model, *batch(0, 0)).backward()
        zero.step()
        results.append(flat_params(model))
    return results[0], results[1]


def test_shard_replicas_on_one_rank_steps_each_parameter_once() -> None:
    theirs, ours = run_ranks(_one_rank_step, 1)[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


LIVENESS = timedelta(seconds=2)
STEPS = 6
LOADED_AT = 2  # the checkpoint holds this many steps
LOST_AT = 3  # rank 2 is lost in this step, after the load


def _adam_checkpoint(world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Model and Adam state after LOADED_AT steps of the reference (every rank's gradients averaged)."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(LOADED_AT):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world_size):
            model.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            for acc, p in zip(total, model.parameters()):
                assert p.grad is not None
                acc += p.grad
        for acc, p in zip(total, model.parameters()):
            p.grad = acc / world_size
        optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def _lose_rank_after_loading(rank: int, world_size: int) -> None:
    """A checkpoint is loaded, then rank 2 is killed: rank 0, which holds the
    replica of rank 2's shard, goes on with the loaded state of that shard."""
    module_state, optimizer_state = _adam_checkpoint(world_size)
    module = make_model()
    module.load_state_dict(module_state)
    model = DistributedDataParallel(module)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01, shard_replicas=1)
    optimizer.load_state_dict(optimizer_state)
    with Join([model, optimizer], on_rank_lost="continue", liveness_timeout=LIVENESS) as join:
        for step in range(LOADED_AT, STEPS):
            optimizer.zero_grad()
            loss = loss_fn(model, *batch(rank, step))
            if rank == 2 and step == LOST_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
    assert list(join.lost_ranks) == [2], join.lost_ranks
    expected = reference([STEPS, STEPS, LOST_AT], lambda ps: torch.optim.Adam(ps, lr=0.01))
    torch.testing.assert_close(flat_params(model.module), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_loaded_state_survives_the_loss_of_its_shards_owner() -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_lose_rank_after_loading, 3, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)


def _load_mismatched_groups(rank: int, world_size: int) -> tuple[str, str]:
    source = make_model()
    params = list(source.parameters())
    groups: list[dict[str, Any]] = [{"params": params[:3]}, {"params": params[3:], "lr": 0.5}]
    saved = torch.optim.Adam(groups, lr=0.1)
    loss_fn(source, *batch(0, 0)).backward()
    saved.step()
    errors = []
    for zero_class in (TorchZero, ZeroRedundancyOptimizer):
        target = list(make_model().parameters())
        zero = zero_class([{"params": target[:2]}, {"params": target[2:]}], torch.optim.Adam, lr=0.1)
        with pytest.raises(ValueError) as refused:
            zero.load_state_dict(saved.state_dict())
        errors.append(str(refused.value))
        assert zero.param_groups[1]["lr"] == 0.1  # nothing loaded
    return errors[0], errors[1]


def test_a_state_dict_whose_groups_differ_in_size_is_refused_as_torchs() -> None:
    theirs, ours = run_ranks(_load_mismatched_groups, 1)[0]
    assert theirs in ours, ours
    assert "group 0 has 3 parameters there, 2 here" in ours, ours


def _add_group_when_overlapped(rank: int, world_size: int) -> tuple[str, str]:
    errors = []
    for zero_class in (TorchZero, ZeroRedundancyOptimizer):
        model = make_model()
        first, *rest = model.parameters()
        zero = zero_class([first], torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
        with pytest.raises(RuntimeError) as refused:
            zero.add_param_group({"params": rest})
        errors.append(str(refused.value))
        assert len(zero.param_groups) == 1
    return errors[0], errors[1]


def test_add_param_group_with_overlap_with_ddp_is_refused_as_torchs() -> None:
    theirs, ours = run_ranks(_add_group_when_overlapped, 1)[0]
    assert theirs in ours, ours
    assert "overlap_with_ddp=False" in ours, ours


class _WithHistory(torch.optim.SGD):
    """Keeps a list in the state of each one-dimensional parameter (a bias)."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() == 1:
                    self.state[param]["history"] = [1.0]
        return super().step(closure)


def _consolidate_unsendable_state(rank: int, world_size: int) -> str:
    model = torch.nn.Linear(2, 2)  # the weight goes to rank 0, the bias to rank 1
    zero = ZeroRedundancyOptimizer(model.parameters(), _WithHistory, lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    zero.step()
    with pytest.raises(TypeError) as refused:
        zero.consolidate_state_dict(to=0)
    return str(refused.value)


@pytest.mark.timeout(60)
def test_state_one_rank_cannot_send_is_an_error_on_every_rank() -> None:
    for error in run_ranks(_consolidate_unsendable_state, 2, timeout=30):
        assert "rank 1: optimizer state 'history' of parameter 1 is a list" in error, error


def _attributes(rank: int, world_size: int) -> list[tuple[int, int, bool]]:
    groups = [dist.group.WORLD, dist.new_group([1])]
    found = []
    for group in groups if rank == 1 else groups[:1]:
        for zero_class in (TorchZero, ZeroRedundancyOptimizer):
            zero = zero_class(make_model().parameters(), torch.optim.SGD, process_group=group, lr=0.1)
            found.append((zero.rank, zero.global_rank, zero.initialized))
    return found


def test_global_rank_and_initialized_are_torchs() -> None:
    rank0, rank1 = run_ranks(_attributes, 2)
    assert rank0 == [(0, 0, True)] * 2
    assert rank1 == [(1, 1, True)] * 2 + [(0, 1, True)] * 2  # in a group of rank 1 alone: rank 0 there


class _Accumulating(torch.optim.Optimizer):
    """Adds the size of the shard it steps to a running total in its groups at each step
    (a value of its own shard, as Prodigy's ``d``)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "total": 0})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["total"] = group["total"] + sum(p.numel() for p in group["params"])
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])


def _replica_group_values(rank: int, world_size: int) -> tuple[int, int]:
    model = make_model()
    zero = ZeroRedundancyOptimizer(model.parameters(), _Accumulating, lr=0.1, shard_replicas=1)
    for step in range(2):
        zero.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        zero.step()
    assert zero._replica is not None
    return int(zero.optim.param_groups[0]["total"]), int(zero._replica.param_groups[0]["total"])


def test_a_replica_keeps_the_values_its_optimizer_keeps_in_its_groups_for_its_shard() -> None:
    # The replica of the previous rank's shard must step as that rank's optimizer does: with the
    # running values of that shard, not of this rank's own (copied into the groups after a step).
    results = run_ranks(_replica_group_values, 2)
    for rank, (_, replica) in enumerate(results):
        assert replica == results[rank - 1][0], results
