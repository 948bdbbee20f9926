"""A distributed sampler that neither pads nor duplicates."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["UnevenDistributedSampler"]


class UnevenDistributedSampler(Sampler[int]):
    """Every sample of ``dataset`` on exactly one rank: no padding, no duplicates.

    Like :class:`torch.utils.data.distributed.DistributedSampler`, rank ``r``
    takes every ``num_replicas``-th index of the (shuffled) order starting at
    ``r``; unlike it, the last samples are not repeated to even the ranks out,
    so ranks may get different counts (one more sample on the first
    ``len(dataset) % num_replicas`` ranks). Train or evaluate under
    :class:`join_core.Join` so that the ranks with fewer batches do not hang.

    Args:
        dataset: a dataset with ``len()``.
        num_replicas: the number of ranks (default: the default group's size).
        rank: this rank (default: its rank in the default group).
        shuffle: shuffle the indices, the same way on every rank.
        seed: the shuffle's seed; the same on every rank.
        drop_last: drop the last ``len(dataset) % num_replicas`` samples of
            the order, so that every rank gets the same count.

    Example::

        sampler = UnevenDistributedSampler(dataset, shuffle=False)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "UnevenDistributedSampler(num_replicas=None or rank=None): the default process "
                    "group is not initialized; call torch.distributed.init_process_group() or pass both"
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"UnevenDistributedSampler(num_replicas={num_replicas}): need at least 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"UnevenDistributedSampler(rank={rank}): out of range for num_replicas={num_replicas}; "
                f"use 0 to {num_replicas - 1}"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        usable = len(dataset) - (len(dataset) % num_replicas if drop_last else 0)
        self.total_size = usable
        #: This rank's number of samples.
        self.num_samples = len(range(rank, usable, num_replicas))

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        return iter(order[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: with ``shuffle``, each epoch has its own order, the
        same on every rank."""
        self.epoch = epoch
