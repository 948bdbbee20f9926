"""UnevenDistributedSampler and exact evaluation under Join: every sample is
seen once, and the synced metric equals the single-process one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_cases import make_model
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from ddp_join import FSDPJoinable, UnevenDistributedSampler
from join_core import Join
from join_core.testing import run_ranks

BATCH_SIZE = 2


def _dataset(length: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(length)
    # float64: a row's result then does not depend, to 1e-12, on the batch it is in.
    return TensorDataset(
        torch.randn(length, 4, generator=gen, dtype=torch.float64),
        torch.randn(length, 2, generator=gen, dtype=torch.float64),
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [0, 1, 5, 7, 13])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_on_exactly_one_rank(world_size: int, length: int, shuffle: bool) -> None:
    dataset = _dataset(length)
    per_rank = [
        list(UnevenDistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=3))
        for rank in range(world_size)
    ]
    assert sorted(i for indices in per_rank for i in indices) == list(range(length))
    assert [len(indices) for indices in per_rank] == [
        len(UnevenDistributedSampler(dataset, world_size, rank)) for rank in range(world_size)
    ]
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


def test_shuffle_follows_seed_and_epoch() -> None:
    dataset = _dataset(50)
    sampler = UnevenDistributedSampler(dataset, 3, 1, shuffle=True, seed=7)
    first = list(sampler)
    assert list(UnevenDistributedSampler(dataset, 3, 1, shuffle=True, seed=7)) == first
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    # Every rank shuffles the same way in an epoch: still a partition.
    others = []
    for rank in (0, 2):
        peer = UnevenDistributedSampler(dataset, 3, rank, shuffle=True, seed=7)
        peer.set_epoch(1)
        others += list(peer)
    assert sorted(second + others) == list(range(50))


def test_drop_last_evens_the_ranks_out() -> None:
    dataset = _dataset(11)
    per_rank = [
        list(UnevenDistributedSampler(dataset, 4, r, shuffle=False, drop_last=True)) for r in range(4)
    ]
    assert [len(indices) for indices in per_rank] == [2, 2, 2, 2]
    assert sorted(i for indices in per_rank for i in indices) == list(range(8))


def test_rejects_a_rank_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"rank=3.*num_replicas=3"):
        UnevenDistributedSampler(_dataset(4), num_replicas=3, rank=3)


def _evaluate(rank: int, world_size: int, length: int) -> tuple[float, float]:
    model = make_model().double()
    fully_shard(model[0])  # type: ignore[index]
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = _dataset(length)
    loader = DataLoader(
        dataset, batch_size=BATCH_SIZE, sampler=UnevenDistributedSampler(dataset, shuffle=False)
    )
    totals = torch.zeros(2, dtype=torch.float64)  # sum of losses, number of samples
    model.eval()
    with torch.no_grad(), Join([FSDPJoinable(model, optimizer)]):
        for x, y in loader:
            losses = torch.nn.functional.mse_loss(model(x), y, reduction="none").sum(dim=1)
            totals += torch.stack([losses.sum(), torch.tensor(len(y), dtype=torch.float64)])
    dist.all_reduce(totals)
    return float(totals[0]), float(totals[1])


def _single_process(length: int) -> tuple[float, float]:
    model = make_model().double()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for x, y in DataLoader(_dataset(length), batch_size=BATCH_SIZE):
            losses = torch.nn.functional.mse_loss(model(x), y, reduction="none").sum(dim=1)
            total += float(losses.sum())
            count += len(y)
    return total, count


@pytest.mark.parametrize(
    "world_size,length",
    [(1, 7), (2, 9), (3, 13), (4, 3)],
    ids=["1-rank-7", "2-ranks-9", "3-ranks-13", "4-ranks-3-one-rank-empty"],
)
def test_evaluation_under_join_equals_single_process_metric(world_size: int, length: int) -> None:
    results = run_ranks(_evaluate, world_size, length, timeout=120)
    expected_sum, expected_count = _single_process(length)
    for total, count in results:
        assert count == expected_count == length
        assert total == pytest.approx(expected_sum, rel=1e-12, abs=0)
