"""Communication hooks: how a bucket of gradients is reduced across ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

__all__ = [
    "CommHook",
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]


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

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the bucket's flat tensor (e.g. by a compressed copy, as
        :func:`fp16_compress_wrapper` does) for the hook that runs next.

        The reduced result the hook returns is copied into the gradients,
        cast to their dtype, whichever tensor it is.
        """
        given: object = buffer  # called untyped too
        if not isinstance(given, torch.Tensor) or given.numel() != self._buffer.numel():
            raise ValueError(
                f"GradBucket.set_buffer(buffer={_described(buffer)}): must be a tensor of the "
                f"bucket's {self._buffer.numel()} elements"
            )
        self._buffer = buffer

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


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor of {value.numel()} elements>"
    return repr(value)


def _group(process_group: Any, bucket: GradBucket) -> dist.ProcessGroup:
    return process_group if isinstance(process_group, dist.ProcessGroup) else bucket.process_group()


def allreduce_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks with one all-reduce (the default).

    ``process_group`` is the group to reduce over, or None for the model's own.
    """
    tensor = bucket.buffer().div_(bucket.divisor())
    work = dist.all_reduce(tensor, group=_group(process_group, bucket), async_op=True)
    future: torch.futures.Future[list[torch.Tensor]] = work.get_future()
    return future.then(lambda f: f.value()[0])


def _compress_hook(
    dtype: torch.dtype, process_group: Any, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    compressed = buffer.div(bucket.divisor()).to(dtype)
    work = dist.all_reduce(compressed, group=_group(process_group, bucket), async_op=True)
    future: torch.futures.Future[list[torch.Tensor]] = work.get_future()

    def decompress(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(f.value()[0])

    return future.then(decompress)


def fp16_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16: half the bytes on the wire, at float16's
    precision. ``process_group`` is the group, or None for the model's own.
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: half the bytes on the wire, float32's
    range at bfloat16's precision. ``process_group`` is the group, or None
    for the model's own.
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


def _compress_wrapper(dtype: torch.dtype, hook: CommHook) -> CommHook:
    if not callable(hook):
        raise TypeError(f"hook={hook!r}: must be a communication hook, hook(state, bucket)")

    def compressed_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        bucket.set_buffer(bucket.buffer().to(dtype))
        return hook(state, bucket)  # the reducer casts the result back into the gradients

    compressed_hook.__name__ = f"{torch.finfo(dtype).dtype}_compressed_{getattr(hook, '__name__', 'hook')}"
    return compressed_hook


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """``hook`` run on a float16 copy of each bucket: half the bytes for any
    reduction (``fp16_compress_wrapper(allreduce_hook)`` is
    :func:`fp16_compress_hook`); the result is cast back into the gradients.
    """
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """``hook`` run on a bfloat16 copy of each bucket, as :func:`fp16_compress_wrapper`."""
    return _compress_wrapper(torch.bfloat16, hook)
