"""Incoming requests: handing them to the RPC layer's handler in order, and sending the replies.

Requests of one peer reach the handler in the order the peer sent them.
When none of the peer's requests waits, the reader thread calls the handler
itself; otherwise the request waits in the peer's strand
(:mod:`tensorpipe_backend.strands`). Replies go through the connection's
outbox, which never waits (:mod:`tensorpipe_backend.outbox`), unless what they
carry inline (not through shared memory) exceeds 16 MiB, includes a tensor a
second connection would carry (8 MiB or more, to another host) or would
take the outbox past 16 MiB; the reader of
their connection, with more frames at hand, keeps small ones for one write
after the others.
"""

from __future__ import annotations

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
from .strands import Strands
from .watch import Watch
from .wire import FrameError, Kind, small_frame

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["Requests"]

_BATCH_FRAMES: Final = 256
# Larger replies go through the outbox too where they can (see Connection.frame_to_post: a
# reader that waited to send one would stop reading, as would the peer's), while the outbox
# holds fewer than this many frames and bytes with it (what a peer that does not read makes
# this worker keep stays bounded).
_POSTED_FRAMES: Final = 64
_POSTED_QUEUE_BYTES: Final = 16 << 20


def _failed(exc: Exception) -> Future[Message]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


class Requests:
    """The requests this worker received and has not answered yet.

    ``me`` names this worker in logs; ``lock`` is the agent's (``calls``
    shares it); ``pool`` runs the strands, which ``watch`` watches;
    ``reverse_map`` gives, per peer, where a reply's tensors land there.
    """

    def __init__(
        self,
        me: str,
        lock: threading.RLock,
        calls: Calls,
        pool: ThreadPoolExecutor,
        reverse_map: Callable[[str], DeviceMap],
        watch: Watch,
        leave_reading: Callable[[], None],
    ) -> None:
        self._me = me
        self._leave_reading = leave_reading
        self._lock = lock
        self._calls = calls
        self._pool = pool
        self._reverse_map = reverse_map
        self._strands: Strands[tuple[Connection, int, Message]] = Strands(
            lock, self._run_waiting, pool, watch
        )
        watch.add(self._strands)
        self._handler: RequestHandler | None = None

    def start(self, handler: RequestHandler) -> None:
        """Begin delivering incoming requests (queued ones first) to ``handler``."""
        with self._lock:
            self._handler = handler
        self._strands.open()

    def enqueue(self, conn: Connection, msg_id: int, message: Message) -> None:
        """Hand a request to the handler, in the order its peer sent it (see the module docstring)."""
        with self._lock:
            self._calls.in_flight += 1
        if self._strands.enqueue(conn.peer.name, (conn, msg_id, message)):
            handler = self._handler
            assert handler is not None  # the strands open once it is set
            self._handle(handler, conn, msg_id, message)

    def _run_waiting(self, request: tuple[Connection, int, Message]) -> None:
        handler = self._handler
        assert handler is not None  # the strands open once it is set
        self._handle(handler, *request)

    def _handle(self, handler: RequestHandler, conn: Connection, msg_id: int, message: Message) -> None:
        try:
            reply = handler(conn.peer, message)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            reply = _failed(exc)
        if reply.done():
            self._send_reply(conn, msg_id, reply)
        else:
            reply.add_done_callback(functools.partial(self._send_reply, conn, msg_id))

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
            if conn.closed:
                return
            outbox = conn.outbox
            # The reader of conn, with more frames at hand, keeps small replies for one write after
            # the others; never waiting to send, it never stops reading (see .outbox).
            keep = (
                current is not None
                and current[0] is conn
                and conn.reader is current[1]
                and len(outbox) < _BATCH_FRAMES
                and conn.stream.has_frame()
            )
            outbox.post(frame, now=not keep)
            if keep and current is not None and conn.reader is not current[1]:
                outbox.flush()  # handed off meanwhile: hand_off may have looked before the post
        finally:
            self._calls.done()

    def _send_reply_now(self, conn: Connection, msg_id: int, reply: Future[Message]) -> None:
        """Send a reply with tensors, a large one or an error: posted whole where it can be."""
        try:
            try:
                message = reply.value()
                prepared = []
                if message.tensors:
                    reverse = self._reverse_map(conn.peer.name)
                    prepared = [
                        prepare_tensor(t, reverse, conn.peer.name, is_request=False) for t in message.tensors
                    ]
                frame = None
                too_many = len(conn.outbox) >= _POSTED_FRAMES
                if not too_many:
                    frame = conn.frame_to_post(Kind.REPLY, msg_id, message.payload, prepared)
                if frame is not None and conn.outbox.queued_bytes() + len(frame) > _POSTED_QUEUE_BYTES:
                    frame, too_many = (
                        None,
                        True,
                    )  # the peer does not read: wait with it (the watch moves reading on)
                if frame is None:
                    if not too_many:
                        # Too large to post: this reader may wait for the peer to read it, as the
                        # peer's reader may for this side (replies crossing): another reads meanwhile.
                        self._leave_reading()
                    conn.write(Kind.REPLY, msg_id, message.payload, prepared)
                elif not conn.closed:
                    conn.outbox.post(frame)
            except OSError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                if isinstance(exc, FrameError):  # over a limit, nothing sent: the caller is told below
                    logger.warning(
                        "%s: the reply %d to %s was not sent: %s", self._me, msg_id, conn.peer.name, exc
                    )
                conn.post(Kind.ERROR, msg_id, f"{type(exc).__name__}: {exc}".encode())
        except (OSError, FrameError) as exc:
            logger.debug("%s: reply %d to %s lost: %s", self._me, msg_id, conn.peer.name, exc)
        finally:
            self._calls.done()
