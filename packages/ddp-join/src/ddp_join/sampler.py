"""A distributed sampler that neither pads nor duplicates."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Final

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from join_core import Join

__all__ = ["UnevenDistributedSampler"]

_CLAIMS: Final = "ddp_join/sampler/claims"  # store keys under which survivors take a lost rank's samples


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

    Under ``Join(on_rank_lost="continue")``, :meth:`follow` makes the
    survivors take over a lost rank's samples.

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
        self.epoch: int = 0
        usable = len(dataset) - (len(dataset) % num_replicas if drop_last else 0)
        self.total_size = usable
        #: This rank's number of samples.
        self.num_samples: int = len(range(rank, usable, num_replicas))
        self._join: Join | None = None
        self._batch_size = 1

    def follow(self, join: Join, batch_size: int) -> None:
        """Take over, with the other survivors, the samples of ranks that
        ``join`` (``on_rank_lost="continue"``) loses.

        A lost rank took part in ``join.contributions[rank]`` iterations, so
        its first that many batches of ``batch_size`` samples were trained
        on; once this rank has drawn its own samples, it draws the lost
        rank's later ones (the batch it had in flight included), a batch at a
        time, claimed through the rendezvous store so that each goes to one
        survivor only. A survivor that has drawn its last sample before the
        loss is agreed takes none; the others take them all.

        Args:
            join: the Join the training loop runs in (this epoch's).
            batch_size: the samples of one iteration of a rank (the DataLoader's).

        Raises:
            ValueError: ``batch_size`` is not positive.
        """
        if batch_size < 1:
            raise ValueError(f"UnevenDistributedSampler.follow(batch_size={batch_size}): must be at least 1")
        self._join = join
        self._batch_size = batch_size

    def _order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(len(self.dataset), generator=generator).tolist()
            return order
        return list(range(len(self.dataset)))

    def indices_of(self, rank: int) -> list[int]:
        """The indices ``rank`` draws of its own this epoch, in order (without
        those it takes over from lost ranks): e.g. a lost rank trained on the
        first ``join.contributions[rank] * batch_size`` of them."""
        if not 0 <= rank < self.num_replicas:
            raise ValueError(
                f"UnevenDistributedSampler.indices_of(rank={rank}): out of range for "
                f"num_replicas={self.num_replicas}"
            )
        return self._order()[rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        yield from order[self.rank : self.total_size : self.num_replicas]
        if self._join is not None:
            yield from self._taken_over(order, self._join)

    def _taken_over(self, order: list[int], join: Join) -> Iterator[int]:
        """The lost ranks' samples this rank claims, a batch at a time."""
        store = join.process_group.get_group_store()
        done: set[int] = set()
        while True:
            lost = {rank: count for rank, count in join.contributions.items() if rank not in done}
            if not lost:
                return
            rank = min(lost)
            left = order[rank : self.total_size : self.num_replicas][lost[rank] * self._batch_size :]
            key = f"{_CLAIMS}/{self.seed}/{self.epoch}/{rank}"
            while True:
                end = int(store.add(key, self._batch_size))
                if end - self._batch_size >= len(left):
                    break
                yield from left[end - self._batch_size : end]
            done.add(rank)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: with ``shuffle``, each epoch has its own order, the
        same on every rank."""
        self.epoch = epoch
