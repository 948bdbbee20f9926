"""Group state in the rendezvous store: worker records, barriers and the membership token.

Records are JSON, never pickle: anyone who can reach the store can write
to it, and reading a record must not run code.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

import torch
from torch.distributed.distributed_c10d import Store

from .options import DeviceMap

logger = logging.getLogger(__name__)

__all__ = ["WorkerRecord", "members", "store_barrier", "membership_token"]

_PREFIX: Final = "tensorpipe_backend"
MEMBERS_KEY: Final = f"{_PREFIX}/members"
_TOKEN_KEY: Final = f"{_PREFIX}/token"
_UNLIMITED: Final = 3600.0 * 24


def record_key(name: str) -> str:
    """Store key of worker ``name``'s record."""
    return f"{_PREFIX}/worker/{name}"


def rank_key(rank: int) -> str:
    """Store key holding the name of the worker of ``rank``."""
    return f"{_PREFIX}/rank/{rank}"


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
            )
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"malformed worker record in the store: {exc}") from exc


def _seconds(timeout: float) -> float:
    return timeout if timeout > 0 else _UNLIMITED


def wait_keys(store: Store, keys: list[str], timeout: float, what: str) -> None:
    """Wait until ``keys`` exist; ``TimeoutError`` naming ``what`` after ``timeout`` s (0: no limit)."""
    try:
        store.wait(keys, timedelta(seconds=_seconds(timeout)))
    except RuntimeError as exc:
        raise TimeoutError(f"waited {timeout:g} s for {what}; it did not happen ({exc})") from exc


def store_barrier(store: Store, key: str, world_size: int, timeout: float, what: str) -> None:
    """Block until ``world_size`` workers reached barrier ``key`` (at most ``timeout`` s; 0: no limit)."""
    if store.add(f"{key}/arrived", 1) == world_size:
        store.set(f"{key}/done", "1")
    wait_keys(store, [f"{key}/done"], timeout, f"all {world_size} workers to reach {what}")


def store_sum_barrier(store: Store, key: str, world_size: int, value: int, timeout: float, what: str) -> int:
    """A barrier that also sums one ``value`` per worker; returns the sum."""
    store.add(f"{key}/sum", value)
    store_barrier(store, key, world_size, timeout, what)
    return store.add(f"{key}/sum", 0)


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
