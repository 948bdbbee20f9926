"""Lightning's reductions, exact while some ranks shadow under a Join."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["is_mean", "mean_over_contributors"]


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
