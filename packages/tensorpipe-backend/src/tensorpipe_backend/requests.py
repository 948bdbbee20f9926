"""Incoming requests: handing them to the RPC layer's handler in order, and sending the replies.

Requests of one peer reach the handler in the order the peer sent them.
When none of the peer's requests is queued, the reader thread calls the
handler itself (the RPC layer's handler only decodes the request and
schedules the call); otherwise the request waits in the peer's strand, which
one worker-pool thread at a time drains. Small replies written by the reader
of their connection, with more frames at hand, are batched into one write.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from torch.futures import Future

from rpc_registry import Message, RequestHandler

from .calls import Calls
from .connection import SMALL_PAYLOAD, Connection, prepare_tensor
from .options import DeviceMap
from .reader import reading
from .wire import FrameError, Kind, small_frame

logger = logging.getLogger(__name__)

__all__ = ["Requests"]

_STRAND_BATCH: Final = 32
_BATCH_FRAMES: Final = 256


def _failed(exc: Exception) -> Future[Message]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


class _Strand:
    """The queued requests of one peer; drained by one worker thread at a time."""

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[Connection, int, Message]] = collections.deque()
        self.running = False


class Requests:
    """The requests this worker received and has not answered yet.

    ``me`` names this worker in logs; ``lock`` is the agent's (``calls``
    shares it); ``pool`` runs the strands; ``reverse_map`` gives, per peer,
    where a reply's tensors land there.
    """

    def __init__(
        self,
        me: str,
        lock: threading.RLock,
        calls: Calls,
        pool: ThreadPoolExecutor,
        reverse_map: Callable[[str], DeviceMap],
    ) -> None:
        self._me = me
        self._lock = lock
        self._calls = calls
        self._pool = pool
        self._reverse_map = reverse_map
        self._strands: dict[str, _Strand] = {}
        self._handler: RequestHandler | None = None

    def start(self, handler: RequestHandler) -> None:
        """Begin delivering incoming requests (queued ones first) to ``handler``."""
        with self._lock:
            self._handler = handler
            ready = [s for s in self._strands.values() if s.queue and not s.running]
            for strand in ready:
                strand.running = True
        for strand in ready:
            self._pool.submit(self._drain, strand)

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` on the worker pool, or here once the pool is shut down."""
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: run it here
            fn(*args)

    def enqueue(self, conn: Connection, msg_id: int, message: Message) -> None:
        """Hand a request to the handler, in the order its peer sent it (see the module docstring)."""
        with self._lock:
            self._calls.in_flight += 1
            strand = self._strands.get(conn.peer.name)
            if strand is None:
                strand = self._strands[conn.peer.name] = _Strand()
            handler = self._handler
            if strand.running or strand.queue or handler is None:
                strand.queue.append((conn, msg_id, message))
                if strand.running or handler is None:
                    return
                strand.running = True
                handler = None
        if handler is None:
            self.submit(self._drain, strand)
        else:
            self._handle(handler, conn, msg_id, message)

    def _handle(self, handler: RequestHandler, conn: Connection, msg_id: int, message: Message) -> None:
        try:
            reply = handler(conn.peer, message)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            reply = _failed(exc)
        if reply.done():
            self._send_reply(conn, msg_id, reply)
        else:
            reply.add_done_callback(functools.partial(self._send_reply, conn, msg_id))

    def _drain(self, strand: _Strand) -> None:
        for _ in range(_STRAND_BATCH):
            with self._lock:
                if not strand.queue:
                    strand.running = False
                    return
                conn, msg_id, message = strand.queue.popleft()
                handler = self._handler
            assert handler is not None
            self._handle(handler, conn, msg_id, message)
        # Let other peers' requests have a worker before continuing with this one.
        self.submit(self._drain, strand)

    def _send_reply(self, conn: Connection, msg_id: int, reply: Future[Message]) -> None:
        try:
            message = reply.value()
        except Exception:  # noqa: BLE001 - _send_reply_now reports it
            message = None
        if message is None or message.tensors or len(message.payload) > SMALL_PAYLOAD:
            self._send_reply_now(conn, msg_id, reply)
            return
        frame = small_frame(Kind.REPLY, msg_id, message.payload)
        current = getattr(reading, "reading", None)
        try:
            with conn.send_lock:
                if conn.closed:
                    return
                conn.batch.append(frame)
                # The reader of conn, with more frames at hand, keeps small replies for one
                # write after the others. Checked under send_lock: hand_off takes it after
                # moving the reader role, so a reply kept here is never left behind.
                if (
                    current is not None
                    and current[0] is conn
                    and conn.reader is current[1]
                    and len(conn.batch) < _BATCH_FRAMES
                    and conn.stream.has_frame()
                ):
                    return
                data, conn.batch = b"".join(conn.batch), []
                conn.sock.sendall(data)
        except OSError as exc:
            logger.debug("%s: replies to %s lost: %s", self._me, conn.peer.name, exc)
        finally:
            self._calls.done()

    def _send_reply_now(self, conn: Connection, msg_id: int, reply: Future[Message]) -> None:
        try:
            try:
                message = reply.value()
                prepared = []
                if message.tensors:
                    reverse = self._reverse_map(conn.peer.name)
                    prepared = [
                        prepare_tensor(t, reverse, conn.peer.name, is_request=False) for t in message.tensors
                    ]
                conn.write(Kind.REPLY, msg_id, message.payload, prepared)
            except (OSError, FrameError):
                raise
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                conn.write(Kind.ERROR, msg_id, f"{type(exc).__name__}: {exc}".encode(), [])
        except (OSError, FrameError) as exc:
            logger.debug("%s: reply %d to %s lost: %s", self._me, msg_id, conn.peer.name, exc)
        finally:
            self._calls.done()
