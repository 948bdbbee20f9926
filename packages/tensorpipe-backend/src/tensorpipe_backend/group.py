"""Group state: worker records, the static group's gloo collectives, the dynamic group's token.

A static group exchanges its records and runs its barriers over its own gloo
process group (torch's default process group is left alone); a dynamic group
keeps its records and membership in the rendezvous store. Records are JSON,
never pickle: anyone who can reach the store or the group can send bytes,
and reading a record must not run code.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Final, Protocol, cast

import torch
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, BarrierOptions
from torch.distributed.distributed_c10d import (
    PrefixStore,
    ProcessGroupGloo,
    Store,
    Work,
)

from .options import DeviceMap

logger = logging.getLogger(__name__)

__all__ = ["GlooGroup", "WorkerRecord", "members", "membership_token"]

_PREFIX: Final = "tensorpipe_backend"
MEMBERS_KEY: Final = f"{_PREFIX}/members"
_TOKEN_KEY: Final = f"{_PREFIX}/token"
_GLOO_PREFIX: Final = f"{_PREFIX}/gloo"
_UNLIMITED: Final = 3600.0 * 24


def record_key(name: str) -> str:
    """Store key of worker ``name``'s record."""
    return f"{_PREFIX}/worker/{name}"


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker publishes: where it listens and its device configuration."""

    name: str
    rank: int
    host: str
    port: int
    device_count: int
    device_maps: dict[str, DeviceMap]
    devices: list[torch.device]
    shm_host: str = ""
    """The worker's ``shm.host_identity()``: equal on two workers that can share ``/dev/shm`` files."""
    local_socket: str = ""
    """Name of the worker's Unix socket in the abstract namespace, for peers on its host; or empty."""

    def to_json(self) -> str:
        """Serialize for the store."""
        return json.dumps(
            {
                "name": self.name,
                "rank": self.rank,
                "host": self.host,
                "port": self.port,
                "device_count": self.device_count,
                "device_maps": {
                    to: [[str(src), str(dst)] for src, dst in map_.items()]
                    for to, map_ in self.device_maps.items()
                },
                "devices": [str(device) for device in self.devices],
                "shm_host": self.shm_host,
                "local_socket": self.local_socket,
            }
        )

    @classmethod
    def from_json(cls, text: bytes | str) -> WorkerRecord:
        """Parse a record; ``ValueError`` when it is malformed."""
        try:
            raw = json.loads(text)
            return cls(
                name=str(raw["name"]),
                rank=int(raw["rank"]),
                host=str(raw["host"]),
                port=int(raw["port"]),
                device_count=int(raw["device_count"]),
                device_maps={
                    str(to): {torch.device(src): torch.device(dst) for src, dst in pairs}
                    for to, pairs in raw["device_maps"].items()
                },
                devices=[torch.device(device) for device in raw["devices"]],
                shm_host=str(raw.get("shm_host", "")),
                local_socket=str(raw.get("local_socket", "")),
            )
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"malformed worker record in the store: {exc}") from exc


def _seconds(timeout: float) -> float:
    return timeout if timeout > 0 else _UNLIMITED


class _Collectives(Protocol):
    """The collectives of ``ProcessGroupGloo`` used here; torch's stubs declare them on ``ProcessGroup`` only."""

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions,
    ) -> Work: ...
    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions) -> Work: ...
    def barrier(self, opts: BarrierOptions) -> Work: ...


class GlooGroup:
    """A static group's own gloo process group, made from the rendezvous store.

    Every collective waits at most ``timeout`` seconds (0: no limit) and
    raises ``TimeoutError`` naming what it waited for. :meth:`close` releases
    the group's threads and connections.
    """

    def __init__(self, store: Store, rank: int, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        try:
            group = ProcessGroupGloo(
                PrefixStore(_GLOO_PREFIX, store), rank, world_size, timedelta(seconds=_seconds(timeout))
            )
        except RuntimeError as exc:
            raise TimeoutError(
                f"rank {rank}: waited {timeout:g} s for all {world_size} workers to connect their gloo "
                f"group; it did not happen ({exc})"
            ) from exc
        self._group: _Collectives | None = cast(_Collectives, group)

    def _run(self, start: Callable[[_Collectives, timedelta], Work], timeout: float, what: str) -> None:
        group = self._group
        if group is None:
            raise RuntimeError(f"cannot wait for {what}: the group's gloo process group is closed")
        limit = timedelta(seconds=_seconds(timeout))
        try:
            start(group, limit).wait(limit)
        except RuntimeError as exc:
            raise TimeoutError(
                f"waited {timeout:g} s for all {self.world_size} workers to reach {what}; "
                f"it did not happen ({exc})"
            ) from exc

    def all_gather(self, tensor: torch.Tensor, timeout: float, what: str) -> list[torch.Tensor]:
        """Every worker's ``tensor`` (all of one shape and dtype), by rank."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]

        def start(group: _Collectives, limit: timedelta) -> Work:
            opts = AllgatherOptions()
            opts.timeout = limit
            return group.allgather([out], [tensor], opts)

        self._run(start, timeout, what)
        return out

    def all_gather_bytes(self, data: bytes, timeout: float, what: str) -> list[bytes]:
        """Every worker's ``data``, by rank: the lengths, then the bytes padded to the longest."""
        lengths = [int(n) for n in self.all_gather(torch.tensor([len(data)]), timeout, what)]
        padded = torch.tensor(list(data.ljust(max(lengths), b"\0")), dtype=torch.uint8)
        chunks = self.all_gather(padded, timeout, what)
        return [bytes(chunk[:n].tolist()) for chunk, n in zip(chunks, lengths)]

    def all_reduce_sum(self, value: int, timeout: float, what: str) -> int:
        """The sum of every worker's ``value``."""
        tensor = torch.tensor([value])

        def start(group: _Collectives, limit: timedelta) -> Work:
            opts = AllreduceOptions()
            opts.timeout = limit
            return group.allreduce([tensor], opts)

        self._run(start, timeout, what)
        return int(tensor)

    def barrier(self, timeout: float, what: str) -> None:
        """Block until every worker reached this barrier."""

        def start(group: _Collectives, limit: timedelta) -> Work:
            opts = BarrierOptions()
            opts.timeout = limit
            return group.barrier(opts)

        self._run(start, timeout, what)

    def close(self) -> None:
        """Release the gloo group: its threads stop and its connections close."""
        self._group = None


def members(store: Store) -> list[str]:
    """Names of the dynamic group's members, in joining order."""
    if not store.check([MEMBERS_KEY]):
        return []
    raw = json.loads(store.get(MEMBERS_KEY))
    return [str(name) for name in raw]


def set_members(store: Store, names: list[str]) -> None:
    """Replace the dynamic group's member list (hold the membership token)."""
    store.set(MEMBERS_KEY, json.dumps(names))


@contextmanager
def membership_token(store: Store, holder: str, timeout: float) -> Iterator[None]:
    """Hold the dynamic group's token, so that joins and leaves happen one at a time."""
    deadline = time.monotonic() + _seconds(timeout)
    delay = 0.005
    while True:
        current = store.compare_set(_TOKEN_KEY, "", holder).decode()
        if current == holder:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{holder}: waited {timeout:g} s for the group membership token, held by {current!r}; "
                "that worker may have died while joining or leaving"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    try:
        yield
    finally:
        store.compare_set(_TOKEN_KEY, holder, "")
