"""Deadlines of calls: one thread fails each call whose timeout passed before its reply.

A call's result future is settled once (:meth:`_Deadlines.claim` decides by
whom): by its reply, or by this module's thread with a ``TimeoutError`` that
names the call.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any

from torch.futures import Future

from .errors import _name_of
from .rref import fail

# The engine's machinery, no public API.
__all__: list[str] = []


class _Call:
    """A call's result future, settled once: by its reply or by its deadline."""

    __slots__ = ("result", "what")

    def __init__(self, result: Future[Any], what: tuple[str, str, object, object]) -> None:
        self.result: Future[Any] | None = result
        self.what: tuple[str, str, object, object] | None = what  # caller, callee, request kind, target

    def describe(self, what: tuple[str, str, object, object]) -> str:
        me, to, kind, target = what
        return f"rpc from {me} to {to} ({_describe((kind, target))})"


class _Deadlines:
    """One thread that fails calls whose timeout passed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, float, _Call]] = []
        self._live = 0
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rpc-registry-timeouts", daemon=True)
        self._thread.start()

    def add(self, result: Future[Any], timeout: float, what: tuple[str, str, object, object]) -> _Call:
        """Track ``result``: it fails with ``TimeoutError`` after ``timeout`` s unless settled first."""
        call = _Call(result, what)
        deadline = time.monotonic() + timeout
        with self._lock:
            self._live += 1
            if timeout <= 0:
                return call
            # Wake the timer thread only if it now has to wake earlier.
            earliest = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, next(self._seq), timeout, call))
            if earliest:
                self._cond.notify()
            elif len(self._heap) > 1024 and len(self._heap) > 4 * self._live:
                # Settled calls leave their deadline behind: drop those, keep the heap small.
                self._heap = [entry for entry in self._heap if entry[3].result is not None]
                heapq.heapify(self._heap)
        return call

    def claim(self, call: _Call) -> Future[Any] | None:
        """The call's future if this is the first claim (its settler completes it), else ``None``."""
        with self._lock:
            result, call.result = call.result, None
            if result is not None:
                self._live -= 1
                call.what = None
        return result

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            expired: list[tuple[Future[Any], _Call, tuple[str, str, object, object], float]] = []
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    delay = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(delay)
                if self._stopped:
                    return
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, _, timeout, call = heapq.heappop(self._heap)
                    what, result = call.what, call.result
                    if result is not None and what is not None:
                        call.result, call.what = None, None  # claimed
                        self._live -= 1
                        expired.append((result, call, what, timeout))  # described outside the lock
            if expired:
                # On a thread of their own: a future's callbacks run on the thread that completes
                # it, and one that waits for another call (which may time out too) must not stop
                # this one.
                threading.Thread(
                    target=_time_out, args=(expired,), name="rpc-registry-timeout", daemon=True
                ).start()
            del expired  # keep no finished call alive in this frame


def _time_out(expired: list[tuple[Future[Any], _Call, tuple[str, str, object, object], float]]) -> None:
    for result, call, what, timeout in expired:
        fail(
            result,
            TimeoutError(
                f"{call.describe(what)}: no reply within {timeout:g} s; pass a larger timeout, "
                "or timeout=0 to wait without limit"
            ),
        )


def _describe(request: tuple[object, ...]) -> str:
    kind = request[0]
    if kind in ("call", "remote"):
        return f"{kind} {_name_of(request[1])}"
    return f"{kind} RRef {request[1]}"
