"""Communication hooks: how a bucket of gradients is reduced across ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

__all__ = ["CommHook", "GradBucket", "allreduce_hook", "fp16_compress_hook"]


class GradBucket:
    """One bucket of gradients, handed to a communication hook.

    ``buffer()`` is a flat tensor of the bucket's gradients (in the bucket's
    parameter order, each starting at its entry of ``offsets``, by default
    packed one after the other); the hook returns a future of a tensor of the
    same shape holding the reduced gradients.
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        parameters: list[torch.nn.Parameter],
        is_last: bool,
        divisor: int,
        process_group: dist.ProcessGroup,
        offsets: list[int] | None = None,
    ) -> None:
        if offsets is None:
            offsets = [0]
            for param in parameters[:-1]:
                offsets.append(offsets[-1] + param.numel())
        if len(offsets) != len(parameters):
            raise ValueError(
                f"GradBucket(offsets={offsets}): needs one offset per parameter ({len(parameters)})"
            )
        self._offsets = offsets
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._is_last = is_last
        self._divisor = divisor
        self._process_group = process_group

    def index(self) -> int:
        """The bucket's position; buckets are reduced in index order."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket."""
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients the buffer holds, in order."""
        return self._parameters

    def gradients(self) -> list[torch.Tensor]:
        """Views of the buffer, one per parameter, shaped like it."""
        return [
            self._buffer[offset : offset + param.numel()].view_as(param)
            for param, offset in zip(self._parameters, self._offsets)
        ]

    def is_last(self) -> bool:
        """True for the last bucket of the iteration."""
        return self._is_last

    def divisor(self) -> int:
        """What the summed gradients are divided by this iteration: the world
        size, or under ``model.join(divide_by_initial_world_size=False)`` the
        number of ranks still training."""
        return self._divisor

    def process_group(self) -> dist.ProcessGroup:
        """The process group of the model this bucket belongs to."""
        return self._process_group


#: ``hook(state, bucket)`` reduces a bucket and returns a future of the result.
CommHook: TypeAlias = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


def _group(state: Any, bucket: GradBucket) -> dist.ProcessGroup:
    return state if isinstance(state, dist.ProcessGroup) else bucket.process_group()


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks with one all-reduce (the default).

    ``state`` is the process group, or None for the model's own.
    """
    tensor = bucket.buffer().div_(bucket.divisor())
    work = dist.all_reduce(tensor, group=_group(state, bucket), async_op=True)
    future: torch.futures.Future[list[torch.Tensor]] = work.get_future()
    return future.then(lambda f: f.value()[0])


def fp16_compress_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16: half the bytes on the wire, at float16's
    precision. ``state`` is the process group, or None for the model's own.
    """
    buffer = bucket.buffer()
    compressed = buffer.div(bucket.divisor()).to(torch.float16)
    work = dist.all_reduce(compressed, group=_group(state, bucket), async_op=True)
    future: torch.futures.Future[list[torch.Tensor]] = work.get_future()

    def decompress(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(f.value()[0])

    return future.then(decompress)
