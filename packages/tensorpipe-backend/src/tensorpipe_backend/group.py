"""Group state: worker records, and the dynamic group's membership token.

A static group's members publish their records in the rendezvous store
signed with the job's secret (HMAC-SHA256), so a record someone else wrote
is refused; its barriers run over the agent's own connections
(:mod:`tensorpipe_backend.rounds`). A dynamic group keeps its records and
membership in the store. Records are JSON, never pickle: anyone who can
reach the store can write bytes, and reading a record must not run code.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

import torch
from torch.distributed.distributed_c10d import Store

from .options import DeviceMap

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "WorkerRecord",
    "gather_signed_records",
    "raise_if_failed",
    "read_record",
    "report_failure",
    "members",
    "membership_token",
    "nobody_listens",
    "publish_signed_record",
    "remove_lost_member",
    "static_group_met",
]

_PREFIX: Final = "tensorpipe_backend"
MEMBERS_KEY: Final = f"{_PREFIX}/members"
_TOKEN_KEY: Final = f"{_PREFIX}/token"
_FAILURES_KEY: Final = f"{_PREFIX}/failures"
_PUBLISHED_KEY: Final = f"{_PREFIX}/static/published"
# A wait on the store polls (store.wait's timeouts would each log a warning): quickly at first.
_FIRST_POLL: Final = 0.002
_POLL: Final = 0.2
_MAX_FAILURE_TEXT: Final = 2000
_UNLIMITED: Final = 3600.0 * 24
# A worker waiting for the membership token asks whether its holder still listens after this many
# seconds on one holding, and again as often.
_ASK_HOLDER_EVERY: Final = 1.0


def record_key(name: str) -> str:
    """Store key of worker ``name``'s record."""
    return f"{_PREFIX}/worker/{name}"


_ABSENT: Final = "\0absent"


def read_record(store: Store, name: str) -> WorkerRecord | None:
    """Worker ``name``'s record in ``store``, or ``None`` if it has none: one read that never
    waits. (``check`` then ``get`` would wait out the store's timeout for a record that a peer
    deletes in between: a worker that left, or one judged lost.)"""
    # compare_set with an expected value no record has: the value if the key is there, else the
    # expected value, and nothing written either way.
    value = store.compare_set(record_key(name), _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else WorkerRecord.from_json(value)


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


def _static_key(rank: int) -> str:
    return f"{_PREFIX}/static/{rank}"


def _mac(secret: bytes, key: str, text: str) -> str:
    return hmac.new(secret, b"record\0" + key.encode() + b"\0" + text.encode(), hashlib.sha256).hexdigest()


def publish_signed_record(store: Store, record: WorkerRecord, secret: bytes) -> None:
    """Publish a static group member's record, signed with the job's secret."""
    key, text = _static_key(record.rank), record.to_json()
    store.set(key, f"{text}\n{_mac(secret, key, text)}")
    store.add(_PUBLISHED_KEY, 1)


def _failure_key(rank: int) -> str:
    return f"{_PREFIX}/failed/{rank}"


def report_failure(store: Store, rank: int, error: BaseException) -> None:
    """Tell the static group's other members why this one cannot join, so that they fail at once
    with the cause instead of waiting out their timeout (best effort: the store may be gone)."""
    try:
        store.set(_failure_key(rank), f"{type(error).__name__}: {error}"[:_MAX_FAILURE_TEXT])
        store.add(_FAILURES_KEY, 1)
    except (RuntimeError, OSError) as exc:
        logger.debug("rank %d: could not tell the group why it failed: %s", rank, exc)


def raise_if_failed(store: Store, rank: int, ranks: range) -> None:
    """Raise ``RuntimeError`` with the cause if one of ``ranks`` (not this one) reported a failure."""
    if store.add(_FAILURES_KEY, 0) == 0:
        return
    for r in ranks:
        if r != rank and store.check([_failure_key(r)]):
            cause = store.get(_failure_key(r)).decode(errors="replace")[:_MAX_FAILURE_TEXT]
            raise RuntimeError(f"rank {rank}: rank {r} could not join the group: {cause}")


def wait_or_fail(
    store: Store, keys: list[str], rank: int, ranks: range, timeout: float, count_key: str | None = None
) -> bool:
    """Wait at most ``timeout`` s for ``keys``; whether they came. Fails as soon as one of ``ranks``
    reports a failure (:func:`raise_if_failed`). With ``count_key`` (a counter each writer of one
    of ``keys`` adds 1 to), polls that counter, not every key."""
    deadline = time.monotonic() + _seconds(timeout)
    delay = _FIRST_POLL
    while True:
        if (count_key is None or store.add(count_key, 0) >= len(keys)) and store.check(keys):
            return True
        raise_if_failed(store, rank, ranks)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, _POLL)


def gather_signed_records(
    store: Store, secret: bytes, world_size: int, rank: int, timeout: float
) -> list[WorkerRecord]:
    """Every static group member's record, by rank, once all are published (at most ``timeout`` s).

    Raises:
        TimeoutError: naming the ranks that did not publish in time.
        RuntimeError: another member reported that it could not join, and why.
        ValueError: a record is not signed with the job's secret, or is malformed.
    """
    keys = [_static_key(r) for r in range(world_size)]
    started = time.monotonic()
    if not wait_or_fail(store, keys, rank, range(world_size), timeout, _PUBLISHED_KEY):
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TimeoutError(
            f"rank {rank}: waited {time.monotonic() - started:.1f} s for the records of all {world_size} "
            f"workers; rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))} did not publish "
            "theirs (did they start, with the same init_method and world_size?)"
        )
    records = []
    for r, key in enumerate(keys):
        text, _, mac = store.get(key).decode(errors="replace").rpartition("\n")
        if not hmac.compare_digest(mac, _mac(secret, key, text)):
            raise ValueError(
                f"the record of rank {r} in the rendezvous store is not signed with this worker's secret: "
                "that worker holds a different secret (give every worker the same auth_token), or another "
                "program wrote to the store"
            )
        record = WorkerRecord.from_json(text)
        if record.rank != r:
            raise ValueError(f"the record of rank {r} in the rendezvous store claims rank {record.rank}")
        records.append(record)
    return records


def members(store: Store) -> list[str]:
    """Names of the dynamic group's members, in joining order."""
    if not store.check([MEMBERS_KEY]):
        return []
    raw = json.loads(store.get(MEMBERS_KEY))
    return [str(name) for name in raw]


def static_group_met(store: Store) -> bool:
    """Whether a static group (``init_rpc`` with ``world_size``) met in this store."""
    return bool(store.check([_static_key(0)]))


def set_members(store: Store, names: list[str]) -> None:
    """Replace the dynamic group's member list (hold the membership token)."""
    store.set(MEMBERS_KEY, json.dumps(names))


@contextmanager
def membership_token(
    store: Store,
    holder: str,
    timeout: float,
    lost: Callable[[str], bool] | None = None,
    address: tuple[str, int] | None = None,
) -> Iterator[None]:
    """Hold the dynamic group's token, so that joins and leaves happen one at a time.

    ``address`` is where the holder listens, written with the token. A token
    whose holder is a worker judged lost (``lost(holder)``), or that was held
    for a second by a worker at whose address nobody listens any more (its
    process ended), is taken over: that worker will not give it back.
    """
    mine = _token_value(holder, address)
    deadline = time.monotonic() + _seconds(timeout)
    delay = 0.005
    seen, ask_at = "", 0.0
    while True:
        current = store.compare_set(_TOKEN_KEY, "", mine).decode()
        if current == mine:
            break
        name, where = _token_holder(current)
        now = time.monotonic()
        if current != seen:
            seen, ask_at = current, now + _ASK_HOLDER_EVERY
        why = None
        if current and lost is not None and lost(name):
            why = "was lost"
        elif where is not None and now >= ask_at:
            ask_at = now + _ASK_HOLDER_EVERY
            if nobody_listens(where):
                why = f"no longer listens at {where[0]}:{where[1]}: its process ended"
        if why is not None:
            logger.warning("%s: takes over the membership token of %r, which %s", holder, name, why)
            if store.compare_set(_TOKEN_KEY, current, mine).decode() == mine:
                break
            continue
        if now > deadline:
            raise TimeoutError(
                f"{holder}: waited {timeout:g} s for the group membership token, held by {name!r}; "
                "that worker may have died while joining or leaving"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    try:
        yield
    finally:
        store.compare_set(_TOKEN_KEY, mine, "")


def _token_value(holder: str, address: tuple[str, int] | None) -> str:
    if address is None:
        return holder
    return json.dumps({"holder": holder, "host": address[0], "port": address[1]})


def _token_holder(value: str) -> tuple[str, tuple[str, int] | None]:
    """Who holds the token of ``value``, and where it listens (None: not told)."""
    if value.startswith("{"):
        try:
            raw = json.loads(value)
            return str(raw["holder"]), (str(raw["host"]), int(raw["port"]))
        except (ValueError, KeyError, TypeError):
            pass
    return value, None


def nobody_listens(address: tuple[str, int]) -> bool:
    """Whether a connection to ``address`` is refused: the worker that listened there ended (a
    listening worker accepts it; it is closed at once, before any byte, as a client that hangs up)."""
    try:
        sock = socket.create_connection(address, timeout=_ASK_HOLDER_EVERY)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # unreachable or slow: not proof that it ended
    sock.close()
    return False


def remove_lost_member(
    store: Store,
    me: str,
    record: WorkerRecord,
    timeout: float,
    lost: Callable[[str], bool],
    address: tuple[str, int] | None = None,
) -> bool:
    """Take the lost worker of ``record`` out of the dynamic group: out of the member list, and its
    record out of the store (so that its name is free to join again); whether this call did.

    Several survivors may try: the first does it. Nothing is removed when the
    name now belongs to another worker (one that joined under it since), or
    when ``me`` is no longer a member itself (its peers judged *it* lost:
    ``RuntimeError``). Holds the membership token (``lost`` tells whose token
    may be taken over; ``address`` is where ``me`` listens) for at most
    ``timeout`` seconds.
    """
    key = record_key(record.name)
    with membership_token(store, f"{me} (removing {record.name})", timeout, lost, address):
        names = members(store)
        if me not in names:
            raise RuntimeError(
                f"{me} is no longer a member of the group (its peers judged it lost); it does not "
                f"remove {record.name}"
            )
        current = read_record(store, record.name)
        if current is not None and current != record:
            return False  # the name is another worker's now
        if record.name in names:
            set_members(store, [n for n in names if n != record.name])
        if current is not None:
            store.delete_key(key)
        return record.name in names or current is not None
