"""Slow calls named with what the callee is running.

An ``rpc_sync`` that waits longer than :func:`report_slow_calls`'s threshold
(30 s by default) asks its callee, by an RPC of its own, for the stack of
each thread running a call of this worker's, and logs it: a handler blocked
on a lock or in a loop is named without waiting for the RPC timeout. The
callee answers from another handler thread, so a blocked one does not hold
the answer up. Calls are tracked in two dictionaries (a few hundred
nanoseconds a call); a thread wakes twice a second while calls wait.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Final

__all__ = ["DEFAULT_SLOW_CALL_THRESHOLD", "handler_stacks", "report_slow_calls"]

logger: logging.Logger = logging.getLogger(__name__)

#: How long an ``rpc_sync`` waits before its callee is asked what it runs.
DEFAULT_SLOW_CALL_THRESHOLD: Final = 30.0
_ASK_TIMEOUT_S: Final = 10.0
_MAX_FRAMES: Final = 30

_threshold: list[float | None] = [DEFAULT_SLOW_CALL_THRESHOLD]
#: Callee side: handler thread -> (caller, function, started).
running: dict[int, tuple[str, str, float]] = {}
#: Caller side: token -> (callee, function, started).
waiting: dict[object, tuple[str, str, float]] = {}
_reported: set[object] = set()
_watcher: list[threading.Thread] = []
_lock = threading.Lock()
# Set by the API: (this worker's name, how to ask a worker) while RPC is up.
_asker: list[Callable[[str, float], Any]] = []


def report_slow_calls(after: float | None = DEFAULT_SLOW_CALL_THRESHOLD) -> None:
    """Log what the callee runs when an ``rpc_sync`` has waited ``after`` seconds.

    Args:
        after: the threshold in seconds (positive); None turns the reports off.
    """
    if after is not None and not after > 0:
        raise ValueError(
            f"report_slow_calls(after={after!r}): must be positive seconds, or None to turn it off"
        )
    _threshold[0] = after


def set_asker(ask: Callable[[str, float], Any] | None) -> None:
    """Called by the API at ``init_rpc`` and ``shutdown``: how to run
    :func:`handler_stacks` on a worker (``ask(name, timeout)`` -> Future)."""
    _asker[:] = [ask] if ask is not None else []


def started_waiting(token: object, callee: str, function: str) -> None:
    """A caller begins to wait for ``callee``'s reply."""
    waiting[token] = (callee, function, time.monotonic())
    if not _watcher and _threshold[0] is not None:
        with _lock:
            if not _watcher:
                thread = threading.Thread(target=_watch, name="rpc-slow-calls", daemon=True)
                _watcher.append(thread)
                thread.start()


def stopped_waiting(token: object) -> None:
    """The reply came (or the call failed)."""
    waiting.pop(token, None)
    _reported.discard(token)


def handler_stacks(caller: str) -> list[tuple[str, float, list[str]]]:
    """On the callee: each call of ``caller``'s it runs now, as (function,
    seconds running, stack innermost last)."""
    frames = sys._current_frames()
    now = time.monotonic()
    found = []
    me = threading.get_ident()  # this very call, asking
    for ident, (who, function, started) in list(running.items()):
        frame = frames.get(ident)
        if who == caller and frame is not None and ident != me:
            stack = [line.rstrip() for line in traceback.format_stack(frame, limit=_MAX_FRAMES)]
            found.append((function, now - started, stack))
    return found


def _watch() -> None:
    while True:
        time.sleep(0.5)
        after = _threshold[0]
        if after is None or not _asker:
            continue
        now = time.monotonic()
        for token, (callee, function, started) in list(waiting.items()):
            if now - started > after and token not in _reported:
                _reported.add(token)
                _ask(callee, function, now - started)


def _ask(callee: str, function: str, waited: float) -> None:
    head = f"rpc_sync to {callee} ({function}) has waited {waited:.0f} s"
    try:
        answer = _asker[0](callee, _ASK_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - a report must never disturb the call
        logger.error("%s; asking %s what it runs failed: %s", head, callee, error)
        return

    def told(future: Any) -> None:
        try:
            calls: list[tuple[str, float, list[str]]] = future.value()
        except Exception as error:  # noqa: BLE001 - see above
            logger.error("%s; %s did not tell what it runs: %s", head, callee, error)
            return
        if not calls:
            logger.error(
                "%s; %s runs no call of this worker's: the request or its reply is queued "
                "(all its handler threads busy?) or lost",
                head,
                callee,
            )
            return
        parts = [head]
        for name, seconds, stack in calls:
            parts.append(f"{callee} has been running {name} for {seconds:.0f} s; its stack:")
            parts += [f"  {line}" for entry in stack for line in entry.splitlines()]
        logger.error("%s", "\n".join(parts))

    answer.add_done_callback(told)
