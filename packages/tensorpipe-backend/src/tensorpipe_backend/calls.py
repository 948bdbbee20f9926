"""Calls in flight: the pending calls of each connection, their deadlines, and their replies.

A call sent to a peer is registered on its connection (``Connection.pending``)
until its REPLY or ERROR frame arrives, its deadline passes (the deadline
thread fails it with a ``TimeoutError``), or the connection closes. Requests
received and not yet answered count too: a graceful shutdown waits until
no call is in flight on any worker.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from rpc_registry import Message

from .connection import Connection
from .pending import Pending
from .wire import Kind

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["Calls", "Reply", "remote_failure", "unplaceable"]


class Reply:
    """The reply one thread waits for (see ``TensorPipeAgent.send_wait``); set once."""

    __slots__ = ("_ready", "outcome")

    def __init__(self) -> None:
        self.outcome: Message | BaseException | None = None
        self._ready = threading.Lock()
        self._ready.acquire()

    def set(self, outcome: Message | BaseException) -> None:
        """Set the reply or the error, waking the waiting thread."""
        self.outcome = outcome
        self._ready.release()

    def wait(self) -> Message:
        """The reply, once set; its error is raised."""
        self._ready.acquire()
        outcome = self.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome


def remote_failure(conn: Connection, entry: Pending, payload: bytes) -> RuntimeError:
    """The error an ERROR frame answering ``entry`` stands for."""
    text = payload.decode(errors="replace")
    return RuntimeError(f"worker {conn.peer.name} could not handle {entry.what}: {text}")


def unplaceable(entry: Pending, error: str) -> RuntimeError:
    """The error of a reply to ``entry`` whose tensors cannot be placed here (``error`` says why)."""
    return RuntimeError(f"the reply to {entry.what} cannot be placed here: {error}")


def _start_thread(target: Callable[..., None], what: str, *args: object) -> None:
    threading.Thread(target=target, args=args, name=f"tpb-{what}", daemon=True).start()


def _time_out(expired: list[tuple[Connection, Pending, float]]) -> None:
    """Fail each expired call with its ``TimeoutError``."""
    for conn, entry, timeout in expired:
        if conn.shm is not None:
            conn.shm.release(entry.shm_tokens)
        entry.deliver(
            TimeoutError(
                f"{entry.what}: no reply within {timeout:g} s; pass a larger timeout, "
                "or timeout=0 to wait without limit"
            ),
        )


class Calls:
    """The count of calls in flight, the deadlines of those sent, and the thread that enforces them.

    ``me`` names this worker in logs. Shares the agent's lock (``lock``, with ``cond`` over it): registering a
    call, counting it and checking that its connection is open happen in
    one step. ``in_flight`` counts calls sent and not answered, plus
    requests received and not yet answered; change it under ``lock``.
    """

    def __init__(
        self,
        me: str,
        lock: threading.RLock,
        cond: threading.Condition,
        spawn: Callable[..., None] = _start_thread,
    ) -> None:
        self._me = me
        self._spawn = spawn
        self._lock = lock
        self._cond = cond
        self._timer = threading.Condition(lock)  # wakes only the deadline thread
        self.in_flight: int = 0
        self.idle_waits: int = 0  # threads waiting for no call in flight (done() wakes them)
        self.ids: itertools.count[int] = itertools.count(1)
        self.closed: bool = False
        self._deadlines: list[tuple[float, int, Connection, int, float]] = []
        self._deadline_seq = itertools.count()

    def add(self, conn: Connection, pending: Pending, deadline: float | None, timeout: float) -> bool:
        """Register ``pending`` on ``conn`` with its deadline; ``False`` when ``conn`` is closed."""
        msg_id = pending.msg_id
        with self._lock:
            if conn.closed:
                return False
            conn.pending[msg_id] = pending
            self.in_flight += 1
            if deadline is not None:
                deadlines = self._deadlines
                # Wake the deadline thread only when this deadline comes before all the others.
                earliest = not deadlines or deadline < deadlines[0][0]
                heapq.heappush(deadlines, (deadline, next(self._deadline_seq), conn, msg_id, timeout))
                if earliest:
                    self._timer.notify()
                if len(deadlines) > 1024 and len(deadlines) > 4 * self.in_flight:
                    # Answered calls leave their deadline behind: drop those, keep the heap small.
                    self._deadlines = [d for d in deadlines if d[3] in d[2].pending]
                    heapq.heapify(self._deadlines)
            return True

    def claim(self, conn: Connection, msg_id: int) -> Pending | None:
        """Take the call ``msg_id`` out of ``conn``'s pending calls and of the count in flight.

        No call sits between the removal and the count, so a signal handler
        that raises (main thread) cannot split them."""
        with self._lock:
            entry = conn.pending.get(msg_id)
            if entry is not None:
                del conn.pending[msg_id]
                self.in_flight -= 1
                if self.in_flight == 0 and self.idle_waits:
                    self._cond.notify_all()
        if entry is not None and conn.shm is not None:
            conn.shm.release(entry.shm_tokens)
        return entry

    def answer(
        self,
        conn: Connection,
        kind: Kind,
        msg_id: int,
        payload: bytes,
        tensors: tuple[torch.Tensor, ...],
        error: str | None,
    ) -> None:
        """Complete the call ``msg_id`` with a REPLY or ERROR frame (``error``: why its tensors
        cannot be placed here)."""
        with self._lock:  # against detach(), which fails what is left
            entry = conn.pending.pop(msg_id, None)
        if entry is None:
            logger.debug("%s: late reply %d from %s dropped", self._me, msg_id, conn.peer.name)
            return
        if conn.shm is not None:
            conn.shm.release(entry.shm_tokens)
        outcome: Message | BaseException
        if kind is Kind.ERROR:
            outcome = remote_failure(conn, entry, payload)
        elif error is not None:
            outcome = unplaceable(entry, error)
        else:
            outcome = Message(payload, tensors)
        try:
            entry.deliver(outcome)
        finally:
            self.done()

    def detach(self, conn: Connection) -> dict[int, Pending]:
        """Take every pending call of ``conn`` (which is closing) out of the count; the caller fails them."""
        with self._lock:
            pending, conn.pending = conn.pending, {}
            self.in_flight -= len(pending)
            self._cond.notify_all()
        return pending

    def done(self) -> None:
        """One call fewer in flight; wake the idle waits when none is left."""
        with self._lock:
            self.in_flight -= 1
            if self.in_flight == 0 and self.idle_waits:
                self._cond.notify_all()

    def active(self) -> int:
        """How many calls are in flight."""
        with self._lock:
            return self.in_flight

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait at most ``timeout`` s (``None``: no limit) until no call is in flight; whether none is."""
        with self._lock:
            self.idle_waits += 1
            try:
                return self._cond.wait_for(lambda: self.in_flight == 0, timeout=timeout)
            finally:
                self.idle_waits -= 1

    def close(self) -> None:
        """Stop the deadline thread (hold ``lock``)."""
        self.closed = True
        self._timer.notify_all()

    def run_deadlines(self) -> None:
        """The deadline thread: fail each call whose deadline passed, until :meth:`close`.

        The failures are delivered on a thread of their own: a future's callbacks run on the
        thread that completes it, and one that waits for another call (which may time out too)
        must not stop this one.
        """
        while True:
            expired: list[tuple[Connection, Pending, float]] = []
            with self._lock:
                while not self.closed and (not self._deadlines or self._deadlines[0][0] > time.monotonic()):
                    delay = self._deadlines[0][0] - time.monotonic() if self._deadlines else 1.0
                    self._timer.wait(min(delay, 1.0))
                if self.closed:
                    return
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, _, conn, msg_id, timeout = heapq.heappop(self._deadlines)
                    entry = conn.pending.pop(msg_id, None)
                    if entry is not None:
                        self.in_flight -= 1
                        expired.append((conn, entry, timeout))
                if expired:
                    self._cond.notify_all()
            if expired:
                self._spawn(_time_out, "timeouts", expired)
            del expired  # keep no finished call alive in this frame
