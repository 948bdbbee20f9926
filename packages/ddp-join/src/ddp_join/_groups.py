"""Process-group helpers shared by the modules of this package."""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives take global ranks)."""
    if group is dist.group.WORLD:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


def gather_objects(obj: object, dst: int, group: dist.ProcessGroup) -> list[Any] | None:
    """Pickle ``obj`` on every rank and gather the objects on group rank ``dst``
    (a list in rank order there, None elsewhere). CPU tensors, so it works on
    any backend with CPU support; unlike torch's *_object collectives it does
    not need NumPy."""
    payload = pickle.dumps(obj)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    is_dst = dist.get_rank(group) == dst
    buffers = [torch.empty(longest, dtype=torch.uint8) for _ in sizes] if is_dst else None
    dist.gather(padded, buffers, dst=global_rank(group, dst), group=group)
    if buffers is None:
        return None
    return [pickle.loads(ctypes.string_at(b.data_ptr(), int(s))) for b, s in zip(buffers, sizes)]
