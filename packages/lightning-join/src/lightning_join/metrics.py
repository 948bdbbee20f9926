"""A torchmetrics sync function that leaves out the ranks that have joined."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["gather_all_tensors"]


def gather_all_tensors(result: Tensor, group: Any | None = None) -> list[Tensor]:
    """torchmetrics' ``gather_all_tensors``, correct while ranks shadow under a Join.

    Gathers ``result`` from every rank of ``group`` (default: the world) and
    returns the tensors of the ranks that took part, in rank order; this
    rank's entry is ``result`` itself, with its autograd graph, as in
    torchmetrics. Tensors
    may differ in size along any dimension: they are padded for the gather
    and cut back after.

    A rank that has joined shadows these all-gathers with zeros
    (:class:`join_core.ShadowCollectives`); each rank's first row says
    whether it took part, so a joined rank's zeros are left out instead of
    changing the sizes, and a metric synced on every step
    (``dist_sync_on_step=True``) reduces over the ranks that had a batch.
    :class:`lightning_join.JoinDDPStrategy` sets it on the metrics of the
    LightningModule that have no ``dist_sync_fn`` of their own; pass it
    yourself elsewhere::

        accuracy = MulticlassAccuracy(num_classes=10, dist_sync_fn=gather_all_tensors)

    Unlike torchmetrics' function, it issues no barrier first: the
    all-gathers wait for every rank anyway.
    """
    if group is None:
        group = dist.group.WORLD
    result = result.contiguous()
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    header = torch.tensor([1, *result.shape], dtype=torch.int64, device=result.device)
    headers = [torch.empty_like(header) for _ in range(world_size)]
    dist.all_gather(headers, header, group=group)
    present = [bool(h[0] > 0) for h in headers]
    shapes = [tuple(int(d) for d in h[1:].tolist()) for h in headers]
    sizes = [shape for shape, here in zip(shapes, present) if here]
    if all(shape == tuple(result.shape) for shape in sizes):
        with torch.no_grad():
            gathered = [torch.empty_like(result) for _ in range(world_size)]
            dist.all_gather(gathered, result, group=group)
        gathered[rank] = result
        return [tensor for tensor, here in zip(gathered, present) if here]
    largest = [max(dims) for dims in zip(*sizes)]
    with torch.no_grad():
        padded = result.new_zeros(largest)
        padded[tuple(slice(0, d) for d in result.shape)] = result
        gathered = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(gathered, padded, group=group)
    cut = [g[tuple(slice(0, d) for d in shape)] for g, shape in zip(gathered, shapes)]
    cut[rank] = result
    return [tensor for tensor, here in zip(cut, present) if here]
