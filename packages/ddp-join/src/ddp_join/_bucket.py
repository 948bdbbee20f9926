"""Gradient buckets of DistributedDataParallel: which parameters are reduced
together, and the flat buffer their gradients are gathered into."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import torch
import torch.distributed as dist

#: Elements each gradient's place in a bucket starts on a multiple of (64 bytes
#: or more), so copies and reductions over them run on aligned memory.
ALIGN_ELEMENTS: Final = 16


def aligned(count: int) -> int:
    """``count`` rounded up to a multiple of :data:`ALIGN_ELEMENTS`."""
    return -(-count // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def group_parameters(params: Sequence[torch.nn.Parameter], caps: list[int]) -> list[list[torch.nn.Parameter]]:
    """Parameters in buckets, in reverse order, one dtype per bucket; bucket
    ``i`` closes once it holds ``caps[i]`` bytes (the last cap repeats)."""
    groups: list[list[torch.nn.Parameter]] = []
    open_group: dict[torch.dtype, tuple[int, list[torch.nn.Parameter]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for param in reversed(params):
        opened = open_group.get(param.dtype)
        if opened is None:
            opened = open_group[param.dtype] = (len(groups), [])
            groups.append(opened[1])
            sizes[param.dtype] = 0
        index, current = opened
        current.append(param)
        sizes[param.dtype] += param.numel() * param.element_size()
        # A bucket closes once it reaches its cap, so a large gradient
        # starts reducing as soon as it is ready.
        if sizes[param.dtype] >= caps[min(index, len(caps) - 1)]:
            del open_group[param.dtype]
    return groups


def in_bucket_layout(
    value: torch.Tensor, index: int, params: Sequence[torch.nn.Parameter], offsets: Sequence[int], size: int
) -> torch.Tensor:
    """A communication hook's result laid out as its bucket's buffer (``size`` elements, each
    gradient at its aligned offset). torch's buffer has no padding, so a hook written for it
    may return the gradients packed one after the other: those are spread out."""
    if value.numel() == size:
        return value
    packed = sum(param.numel() for param in params)
    if value.numel() != packed:
        raise ValueError(
            f"a communication hook returned {value.numel()} elements for bucket {index}, whose "
            f"buffer() holds {size} ({packed} of them gradients): return a tensor shaped as "
            "bucket.buffer() (or the gradients packed one after the other)"
        )
    flat = value.reshape(-1)
    laid = torch.zeros(size, dtype=value.dtype, device=value.device)
    start = 0
    for param, offset in zip(params, offsets):
        count = param.numel()
        laid[offset : offset + count] = flat[start : start + count]
        start += count
    return laid


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together, in one flat buffer.

    The buffer starts with ``meta_len`` elements reserved for per-iteration
    metadata (bucket 0 only, when its dtype counts exactly) and ends with
    ``tail_len`` elements for the parameters' arrival flags (the last bucket
    only, with ``find_unused_parameters``)."""

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    meta_len: int
    buffer: torch.Tensor
    tail_len: int = 0
    pending: int = 0
    ready: list[bool] = field(default_factory=list)
    # In flight: a comm hook's future, or the built-in all-reduce's work on ``reduced``.
    future: torch.futures.Future[torch.Tensor] | None = None
    work: dist.Work | None = None
    reduced: torch.Tensor | None = None
    # Each .grad is a view into the buffer (gradient_as_bucket_view, same dtype).
    as_view: bool = False
    # Join(on_rank_lost="continue") only: the buffer as last reduced (for survivors that
    # could not finish that reduction) and, with gradient views, as launched (to redo a
    # reduction without a lost rank; otherwise the gradients in .grad serve).
    completed: torch.Tensor | None = None
    backup: torch.Tensor | None = None
    # The real buffer while a joined rank reduces zeros in another (see lend_zeros).
    lent: torch.Tensor | None = None
    meta: torch.Tensor = field(init=False)
    grads: torch.Tensor = field(init=False)
    tail: torch.Tensor = field(init=False)
    views: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        # Views made once: slicing a tensor costs a microsecond, every step.
        end = self.buffer.numel() - self.tail_len
        self.meta = self.buffer[: self.meta_len]
        self.grads = self.buffer[self.meta_len : end]
        self.tail = self.buffer[end:]
        self.views = [
            self.grads[offset : offset + param.numel()].view_as(param)
            for param, offset in zip(self.params, self.offsets)
        ]

    def keep_copies(self, keep: bool) -> None:
        """Keep the copies above (continue mode) or drop them."""
        if not keep:
            self.completed = self.backup = None
            return
        self.completed = torch.zeros_like(self.buffer)  # zeros: its padding is reduced too, once swapped in
        self.backup = torch.empty_like(self.buffer) if self.as_view else None

    def keep_reduced(self) -> None:
        """Keep the buffer just reduced as ``completed``: without gradient views,
        by taking the other buffer for the next iteration's gradients (no copy)."""
        assert self.completed is not None
        if self.as_view:
            self.completed.copy_(self.buffer)  # .grad views this buffer: it must stay
            return
        self.buffer, self.completed = self.completed, self.buffer
        self.__post_init__()

    def lend_zeros(self) -> None:
        """For a joined rank's reduction with gradient views: zeros in a buffer of their own
        take the real buffer's place, so that ``.grad`` (views of the real one) keeps its values."""
        self.lent = self.buffer
        self.buffer = torch.zeros_like(self.buffer)
        self.__post_init__()

    def take_back(self, keep_result: bool) -> None:
        """End :meth:`lend_zeros` once the reduction completed: the real buffer again, with
        the reduced values copied into it if ``keep_result``."""
        if self.lent is None:
            return
        reduced_whole = self.reduced is self.buffer
        lent, self.buffer, self.lent = self.buffer, self.lent, None
        self.__post_init__()
        if keep_result:
            self.buffer.copy_(lent)
        if self.reduced is not None and self.work is not None:
            self.reduced = self.buffer if reduced_whole else self.grads

    def grad_view(self, position: int) -> torch.Tensor:
        """The part of the buffer that holds parameter ``position``'s gradient."""
        return self.views[position]

    def result(self) -> torch.Tensor:
        """Wait for the reduction in flight; the reduced buffer (or a hook's result)."""
        if self.work is not None:
            self.work.wait()
            assert self.reduced is not None
            return self.reduced
        assert self.future is not None
        return in_bucket_layout(self.future.wait(), self.index, self.params, self.offsets, self.grads.numel())
