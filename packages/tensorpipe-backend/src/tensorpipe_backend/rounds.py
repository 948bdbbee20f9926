"""A static group's collective rounds (barriers, sums), through rank 0, over the agent's connections.

Every worker calls the same rounds in the same order. In round ``n`` each
worker sends its contribution to rank 0 in a ``GROUP`` frame numbered ``n``;
rank 0 waits for all of them and sends every worker the list of all
contributions, by rank. The frames travel on the authenticated connections
of the agent, so bytes from anyone else cannot break a round (as they could
break a gloo group listening on its own ports).

A round fails at once when a worker it waits for is lost (the agent calls
:meth:`GroupRounds.lost`), naming that worker; rank 0 tells the others why a
round failed. A round that may go on without the lost (``skip_lost``: the
shutdown's count of calls in flight) does not wait for them at rank 0; one
whose rank 0 is lost fails everywhere. Every wait has a limit, and its error gives the time actually
waited and, on rank 0, the ranks that did not arrive.
"""

from __future__ import annotations

import itertools
import struct
import threading
import time
from collections.abc import Callable
from typing import Final

__all__ = ["GroupRounds", "RoundFailedError"]

_DATA: Final = 0
_FAILED: Final = 1
_LENGTH: Final = struct.Struct("!I")
_SUM: Final = struct.Struct("!q")
_UNLIMITED: Final = 3600.0 * 24
# Rounds a peer may run ahead of this worker; later ones are a protocol error.
_MAX_AHEAD: Final = 64


class RoundFailedError(ConnectionError):
    """A round of the group could not complete: a worker was lost or failed it."""


def _encode_list(parts: list[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(part)) + part for part in parts)


def _decode_list(data: bytes, count: int) -> list[bytes]:
    parts, offset = [], 0
    try:
        for _ in range(count):
            (length,) = _LENGTH.unpack_from(data, offset)
            offset += _LENGTH.size + length
            parts.append(data[offset - length : offset])
    except struct.error:
        raise RoundFailedError("rank 0 sent a malformed round result") from None
    if offset != len(data):
        raise RoundFailedError("rank 0 sent a malformed round result")
    return parts


class GroupRounds:
    """The rounds of one static group, seen from the worker of ``rank``.

    Args:
        rank: this worker's rank.
        names: every worker's name, by rank.
        send: sends a ``GROUP`` frame ``(round number, payload)`` to the named worker.
    """

    def __init__(self, rank: int, names: list[str], send: Callable[[str, int, bytes], None]) -> None:
        self._rank = rank
        self._names = names
        self._send = send
        self._cond = threading.Condition()
        self._next = itertools.count(1)
        self._current = 0
        self._inbox: dict[int, dict[int, bytes]] = {}  # rank 0: round -> rank -> contribution
        self._results: dict[int, bytes] = {}  # others: round -> rank 0's answer (first byte: kind)
        self._lost: dict[int, str] = {}
        self._closed: str | None = None

    @property
    def coordinator(self) -> str:
        """The name of rank 0, through which every round goes."""
        return self._names[0]

    @property
    def world_size(self) -> int:
        """The number of workers in the group."""
        return len(self._names)

    def barrier(self, timeout: float, what: str) -> None:
        """Block until every worker reached this barrier (``timeout`` seconds, 0: no limit)."""
        self.exchange(b"", timeout, what)

    def sum(self, value: int, timeout: float, what: str, skip_lost: bool = False) -> int:
        """The sum of every worker's ``value`` (with ``skip_lost``, of every worker not lost)."""
        parts = self.exchange(_SUM.pack(value), timeout, what, skip_lost)
        return sum(_SUM.unpack(part)[0] for part in parts if part)

    def exchange(self, data: bytes, timeout: float, what: str, skip_lost: bool = False) -> list[bytes]:
        """Every worker's ``data``, by rank; with ``skip_lost``, rank 0 does not wait for the workers
        lost, whose parts are then empty.

        Raises:
            TimeoutError: not every worker arrived within ``timeout`` (rank 0 names who did not).
            RoundFailedError: a worker was lost, or rank 0 failed the round.
        """
        number = next(self._next)
        started = time.monotonic()
        deadline = started + (timeout if timeout > 0 else _UNLIMITED)
        with self._cond:
            self._current = number
        if self._rank == 0:
            return self._gather(number, data, started, deadline, what, skip_lost)
        self._send(self._names[0], number, data)
        with self._cond:
            while number not in self._results:
                self._check(started, what, [0])
                if not self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0)):
                    self._check(started, what, [0])
                    raise TimeoutError(
                        f"waited {time.monotonic() - started:.1f} s for all {self.world_size} workers to "
                        f"reach {what}; rank 0 ({self._names[0]}) did not say that they all had"
                    )
            answer = self._results.pop(number)
        if answer[:1] == bytes([_FAILED]):
            raise RoundFailedError(f"{what} failed at rank 0: {answer[1:].decode(errors='replace')}")
        return _decode_list(answer[1:], self.world_size)

    def _gather(
        self, number: int, data: bytes, started: float, deadline: float, what: str, skip_lost: bool
    ) -> list[bytes]:
        others = range(1, self.world_size)

        def awaited() -> list[int]:
            return [r for r in others if r not in inbox and not (skip_lost and r in self._lost)]

        with self._cond:
            inbox = self._inbox.setdefault(number, {})
            inbox[0] = data
            failure: Exception | None = None
            try:
                while missing := awaited():
                    self._check(started, what, missing)
                    if not self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0)):
                        missing = awaited()
                        if not missing:
                            break
                        self._check(started, what, missing)
                        raise TimeoutError(
                            f"waited {time.monotonic() - started:.1f} s for all {self.world_size} workers "
                            f"to reach {what}; {_ranks(missing, self._names)} did not arrive"
                        )
            except (TimeoutError, RoundFailedError) as exc:
                failure = exc
            del self._inbox[number]
        if failure is not None:
            # Those who arrived are waiting for an answer: tell them why there is none.
            arrived = [r for r in others if r in inbox]
            self._tell_others(number, bytes([_FAILED]) + str(failure).encode(), arrived)
            raise failure
        parts = [inbox.get(r, b"") for r in range(self.world_size)]
        self._tell_others(number, bytes([_DATA]) + _encode_list(parts), list(others))
        return parts

    def _tell_others(self, number: int, answer: bytes, ranks: list[int]) -> None:
        for rank in ranks:
            if rank in self._lost:
                continue
            try:
                self._send(self._names[rank], number, answer)
            except (OSError, RuntimeError, TimeoutError):
                continue  # that worker will fail the round itself

    def _check(self, started: float, what: str, awaited: list[int]) -> None:
        """Raise if the group closed or a worker this round waits for is lost (hold the lock)."""
        if self._closed is not None:
            raise RoundFailedError(f"cannot complete {what}: {self._closed}")
        for rank in awaited:
            reason = self._lost.get(rank)
            if reason is not None:
                raise RoundFailedError(
                    f"worker {self._names[rank]} (rank {rank}) was lost after "
                    f"{time.monotonic() - started:.1f} s of {what}: {reason}"
                )

    def deliver(self, sender_rank: int, number: int, payload: bytes) -> None:
        """A ``GROUP`` frame arrived from the worker of ``sender_rank``.

        Raises:
            ValueError: the frame breaks the protocol (the agent drops the connection).
        """
        with self._cond:
            if not self._current - _MAX_AHEAD < number <= self._current + _MAX_AHEAD:
                raise ValueError(f"round {number} is out of range (this worker is at round {self._current})")
            if self._rank == 0:
                if not 0 < sender_rank < self.world_size:
                    raise ValueError(f"a round contribution from rank {sender_rank}")
                inbox = self._inbox.setdefault(number, {})
                if sender_rank in inbox:
                    raise ValueError(f"rank {sender_rank} contributed to round {number} twice")
                inbox[sender_rank] = payload
            else:
                if sender_rank != 0 or number in self._results or not payload:
                    raise ValueError(f"an unexpected round answer from rank {sender_rank}")
                self._results[number] = payload
            self._cond.notify_all()

    def lost(self, rank: int, reason: str) -> None:
        """The worker of ``rank`` was lost: rounds waiting for it fail at once (or, with
        ``skip_lost``, go on without it)."""
        with self._cond:
            self._lost.setdefault(rank, reason)
            self._cond.notify_all()

    def close(self, reason: str) -> None:
        """Fail every waiting and later round with ``reason``."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()


def _ranks(ranks: list[int], names: list[str]) -> str:
    listed = ", ".join(f"{r} ({names[r]})" for r in ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {listed}"
