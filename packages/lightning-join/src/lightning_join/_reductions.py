"""Lightning's reductions, exact while some ranks shadow under a Join."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["gather_from_contributors", "gather_summing_gradients", "is_mean", "mean_over_contributors"]


def is_mean(reduce_op: object) -> bool:
    """Whether Lightning's ``reduce_op`` names a mean."""
    return isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")


def mean_over_contributors(tensor: Tensor, group: Any | None = None) -> Tensor:
    """The mean of ``tensor`` over the ranks of ``group`` that contribute.

    A count rides with the values, so a rank that has joined (and shadows
    this all-reduce with zeros) adds nothing to the mean instead of a zero.
    A floating-point tensor is averaged in place, as Lightning does; the mean
    of an integer tensor is returned as a new floating-point tensor instead
    of truncated: Lightning averages the summed batch sizes of an epoch's
    ``sync_dist`` mean, and ``25 / 3`` truncated to 8 made that mean wrong
    whenever the ranks' sample counts do not add up to a multiple of the
    world size.
    """
    floating = tensor.is_floating_point()
    dtype = tensor.dtype if floating else torch.get_default_dtype()
    ones = torch.ones(1, dtype=dtype, device=tensor.device)
    packed = torch.cat([tensor.detach().reshape(-1).to(dtype), ones])
    dist.all_reduce(packed, group=group)
    averaged = (packed[:-1] / packed[-1]).view(tensor.shape)
    return tensor.copy_(averaged) if floating else averaged


def gather_from_contributors(
    tensor: Tensor, group: Any | None, sync_grads: bool, gather: Callable[[Tensor], Tensor]
) -> Tensor:
    """Lightning's ``all_gather`` (``gather``: a ``(world_size, *shape)``
    tensor) without the ranks that have joined: they shadow it with zeros,
    and a flag riding with the values tells those rows apart. The first
    dimension is the number of ranks that gave a tensor, in rank order."""
    flagged = torch.cat([tensor.reshape(-1), tensor.new_ones(1)])
    if sync_grads and dist.get_backend(group) == dist.Backend.GLOO:
        gathered = gather_summing_gradients(flagged, group)
    else:
        gathered = gather(flagged)
    rows = gathered[gathered[:, -1] != 0, :-1]
    return rows.reshape(rows.shape[0], *tensor.shape)


def gather_summing_gradients(tensor: Tensor, group: Any | None = None) -> Tensor:
    """``all_gather`` into a ``(world_size, *shape)`` tensor whose backward
    all-reduces the gradients of every row and keeps this rank's: a rank
    that has joined shadows both with zeros. torch's differentiable gather
    emulates a reduce-scatter over gloo with a scatter from each rank in
    turn, which a joined rank cannot shadow (it would be the source)."""
    gathered: Tensor = _GatherSummingGradients.apply(tensor, group)  # type: ignore[no-untyped-call]
    return gathered


class _GatherSummingGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed[dist.get_rank(ctx.group)], None
