"""Process-group helpers shared by the modules of this package."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Final

import torch
import torch.distributed as dist

_FAILED: Final = -1  # announced instead of a length by a rank that has no data to send
_MAX_REASON: Final = 4096  # bytes of a failed rank's reason that are sent


class PeerFailedError(Exception):
    """Ranks of the group announced, instead of their data, why they have none;
    raised on every rank alike.

    Attributes:
        reasons: each failed rank's reason, by group rank.
    """

    def __init__(self, reasons: dict[int, str]) -> None:
        super().__init__("; ".join(f"rank {rank}: {reason}" for rank, reason in reasons.items()))
        self.reasons = reasons


def resolve_group(process_group: dist.ProcessGroup | None, who: str) -> dist.ProcessGroup:
    """``process_group``, or the world when it is None; a clear error before
    ``init_process_group``."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who}: the default process group is not initialized; "
            "call torch.distributed.init_process_group() first"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None
    return group


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives take global ranks)."""
    if group is dist.group.WORLD:
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


def gather_bytes(
    data: bytes | BaseException,
    dst: int,
    device: torch.device,
    group: dist.ProcessGroup,
    limits: Sequence[int] | None = None,
) -> list[bytes] | None:
    """Every rank's ``data`` gathered on group rank ``dst`` (a list in rank
    order there, None elsewhere). The bytes stay bytes: nothing is unpickled.
    With ``limits`` (bytes, by group rank), every rank raises ``ValueError``
    alike when one rank's data is longer than its limit, before anything that
    size is allocated. A rank that could not make its data passes the error
    instead: every rank raises :class:`PeerFailedError` alike.

    One rank's data at a time crosses ``device`` (a broadcast each, as torch's
    ``consolidate_state_dict``), so that no device holds more than the longest;
    ``dst`` keeps each in host memory. ``device`` is that of the parameters:
    NCCL moves only CUDA tensors; other backends move host memory here."""
    if dist.get_backend(group) != "nccl":
        device = torch.device("cpu")
    sizes = _announce(data, device, group)
    assert not isinstance(data, BaseException)  # _announce raised
    if limits is not None:
        over = [
            (r, int(n), limit) for r, (n, limit) in enumerate(zip(sizes, limits)) if not 0 <= int(n) <= limit
        ]
        if over:
            r, n, limit = over[0]
            raise ValueError(
                f"rank {r} of the group announced {n} bytes, and at most {limit} are accepted from it "
                "(what its share could take); nothing was gathered"
            )
    me = dist.get_rank(group)
    buffer = torch.empty(max(int(s) for s in sizes), dtype=torch.uint8, device=device)
    gathered = []
    for rank, size in enumerate(int(s) for s in sizes):
        part = buffer[:size]
        if rank == me and data:
            part.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if size:
            dist.broadcast(part, src=global_rank(group, rank), group=group)
        if me == dst:
            gathered.append(_to_bytes(part))
    return gathered if me == dst else None


def all_gather_bytes(
    data: bytes | BaseException, device: torch.device, group: dist.ProcessGroup, limit: int
) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (no pickle: the
    bytes stay bytes). Every rank raises ``ValueError`` alike when one rank's
    data is longer than ``limit``, before anything that size is allocated. A
    rank that could not make its data passes the error instead: every rank
    raises :class:`PeerFailedError` alike."""
    sizes = _announce(data, device, group)
    assert not isinstance(data, BaseException)  # _announce raised
    lengths = [int(s) for s in sizes]
    if max(lengths) > limit or min(lengths) < 0:
        raise ValueError(f"ranks sent {lengths} bytes; at most {limit} are accepted")
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffers = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in lengths]
    dist.all_gather(buffers, padded.to(device), group=group)
    return [_to_bytes(b[:n]) for b, n in zip(buffers, lengths)]


def pass_bytes(
    data: bytes | BaseException,
    to: int,
    source: int,
    device: torch.device,
    group: dist.ProcessGroup,
    limits: Sequence[int],
) -> bytes:
    """Send ``data`` to group rank ``to`` and return what group rank ``source``
    sent this one (each rank sends once and receives once, as around a ring):
    no rank holds more than its own data and one other's. The bytes stay bytes.

    Every rank raises ``ValueError`` alike when a rank announces more than its
    limit (bytes, by group rank), before anything that size is allocated; a
    rank that could not make its data passes the error instead: every rank
    raises :class:`PeerFailedError` alike."""
    if dist.get_backend(group) != "nccl":
        device = torch.device("cpu")
    sizes = [int(s) for s in _announce(data, device, group)]
    assert not isinstance(data, BaseException)  # _announce raised
    over = [(r, n, limit) for r, (n, limit) in enumerate(zip(sizes, limits)) if not 0 <= n <= limit]
    if over:
        r, n, limit = over[0]
        raise ValueError(
            f"rank {r} of the group announced {n} bytes, and at most {limit} are accepted from it "
            "(what its share could take); nothing was sent"
        )
    received = torch.empty(sizes[source], dtype=torch.uint8, device=device)
    ops = []
    if data:
        sent = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        ops.append(dist.P2POp(dist.isend, sent, global_rank(group, to), group))
    if sizes[source]:
        ops.append(dist.P2POp(dist.irecv, received, global_rank(group, source), group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return _to_bytes(received)


def _to_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a one-dimensional uint8 tensor, read from host memory in one copy."""
    host = tensor.cpu().contiguous()  # alive while read
    return ctypes.string_at(host.data_ptr(), host.numel())


def _announce(
    data: bytes | BaseException, device: torch.device, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Every rank's length of ``data``, all-gathered; when a rank passed an
    error, its reason is all-gathered too and every rank raises
    :class:`PeerFailedError` (the others would wait for its data)."""
    length = _FAILED if isinstance(data, BaseException) else len(data)
    size = torch.tensor([length], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    failures = [rank for rank, n in enumerate(sizes) if int(n) == _FAILED]
    if not failures:
        return sizes
    reason = str(data).encode()[:_MAX_REASON] if length == _FAILED else b""
    reasons = all_gather_bytes(reason, device, group, _MAX_REASON)
    raise PeerFailedError({rank: reasons[rank].decode(errors="replace") for rank in failures})
