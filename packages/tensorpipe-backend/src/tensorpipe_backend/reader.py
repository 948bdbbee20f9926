"""Who reads a connection: its reader thread, and a caller reading its own reply.

One thread at a time reads a connection, through its buffer, and processes
what it reads itself (the agent's ``dispatch``: running the request,
completing the reply's future). A reader that calls out, or that the watch
finds still busy after four ticks (20 ms, :mod:`tensorpipe_backend.watch`),
hands the socket to a new reader thread, so a slow or nested call never
stalls the connection; requests of one peer reach the handler in the order
the peer sent them. A thread waiting in ``send_wait`` (``rpc_sync``) reads
its reply itself when the reader thread is idle (Linux): see
:meth:`Readers.read_for`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Final, Protocol

import torch

from rpc_registry import Message

from .calls import Calls, Reply, remote_failure, unplaceable
from .connection import Connection
from .watch import Watch
from .wire import FrameError, Kind, TensorDescriptor

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["OWNER", "Dispatch", "Readers", "reading"]

OWNER: Final = "owner"
"""The key of ``Connection.owner``: the reader token or :class:`_Session` that owns the stream."""

_WAIT_TICK: Final = 1.0  # a reader waiting for data checks this often whether its connection closed

reading: threading.local = threading.local()
"""``reading.reading``: (connection, reader token) while a reader thread processes a frame."""


class Dispatch(Protocol):
    """Processes one frame read from ``conn`` (``error``: why its tensors cannot be delivered)."""

    def __call__(
        self,
        conn: Connection,
        kind: Kind,
        msg_id: int,
        payload: bytes,
        tensors: tuple[torch.Tensor, ...],
        error: str | None,
    ) -> None: ...


class _Session:
    """A thread reading its own reply (see :meth:`Readers.read_for`)."""

    __slots__ = ("thread",)

    def __init__(self) -> None:
        self.thread = threading.get_ident()


class Readers:
    """The reader threads of one agent's connections; a room of ``watch`` (see :mod:`.watch`).

    ``me`` names this worker (with ``cuda_count`` devices); ``dispatch``
    processes each frame read, ``drop(conn, reason, probe)`` closes a
    connection that failed (``probe``: it ended or broke, not a malformed frame),
    ``spawn`` starts a named thread, ``connections`` lists the open
    connections.
    """

    def __init__(
        self,
        me: str,
        cuda_count: int,
        calls: Calls,
        dispatch: Dispatch,
        drop: Callable[[Connection, str, bool], None],
        spawn: Callable[..., None],
        connections: Callable[[], list[Connection]],
        watch: Watch,
    ) -> None:
        self._me = me
        self._cuda_count = cuda_count
        self._calls = calls
        self._dispatch = dispatch
        self._drop = drop
        self._spawn = spawn
        self._connections = connections
        self._watch = watch

    def start(self, conn: Connection) -> None:
        """Give ``conn`` its first reader thread."""
        self._spawn(self.read_loop, f"read-{conn.peer.name}", conn, conn.reader)

    def read_loop(self, conn: Connection, token: object, holding: bool = False) -> None:
        """Read and process frames while this thread holds ``conn``'s reader token.

        Where ``send_wait`` can read its reply in the caller's thread, the
        reader waits for data without owning the stream (in ``conn.data_wait``)
        and takes ``conn.owner`` for each run of frames it reads and
        processes; elsewhere it keeps it. A reader handed the socket
        (``holding``) owns the stream from the start.
        """
        reason, probe = "the connection closed", False
        stream = conn.stream
        owner = conn.owner
        data_wait = conn.data_wait
        watch = self._watch
        if holding and data_wait is not None:
            data_wait.resume(False)
        wait = not stream.buffered
        try:
            while True:
                if not holding:
                    if wait and data_wait is not None:
                        conn.outbox.flush()  # about to wait for the peer: kept replies go out first
                        if not data_wait.wait(_WAIT_TICK):
                            if conn.closed:
                                return
                            self._heal(conn)
                            wait = not stream.buffered
                            continue
                    if owner.setdefault(OWNER, token) is not token:
                        # A caller reads its own reply and resumes the wait when done, unless a
                        # signal cut it short: then the stream is taken back here.
                        self._heal(conn)
                        wait = True
                        continue
                    holding = True
                    if conn.reader is not token or conn.closed:
                        return
                if not stream.has_frame():
                    conn.outbox.flush()  # read_frame may wait for the peer
                header, descs, payload = stream.read_frame()
                tensors, error = (
                    conn.receive_tensors(descs, self._cuda_count, self._me) if descs else ((), None)
                )
                with conn.role_lock:
                    conn.busy = watch.job()
                if watch.sleeping:
                    watch.wake()
                reading.reading = (conn, token)
                try:
                    self._dispatch(conn, header.kind, header.msg_id, payload, tensors, error)
                finally:
                    reading.reading = None
                    tensors = ()  # a pooled shared-memory file is released when its tensor dies
                with conn.role_lock:
                    if conn.reader is not token:
                        holding = False  # another thread reads now; it owns the stream
                        return
                    conn.busy = 0
                if data_wait is not None and not stream.has_frame():
                    owner.pop(OWNER, None)
                    holding = False
                    wait = not stream.buffered
        except (FrameError, OSError, EOFError) as exc:
            reason, probe = self._read_failure(conn, exc), not isinstance(exc, FrameError)
        finally:
            if conn.reader is token:
                self._drop(conn, reason, probe)
            if holding and owner.get(OWNER) is token:
                owner.pop(OWNER, None)

    def _read_failure(self, conn: Connection, exc: Exception) -> str:
        """Why reading ``conn`` failed with ``exc``, for its pending calls (a malformed frame is logged)."""
        if isinstance(exc, FrameError):
            reason = f"it sent a malformed frame ({exc})"
            logger.warning("%s: closing the connection to %s: %s", self._me, conn.peer.name, reason)
            return reason
        return "the connection closed" if isinstance(exc, EOFError) else f"the connection failed ({exc})"

    def read_for(self, conn: Connection, msg_id: int, reply: Reply, deadline: float | None) -> None:
        """Read the reply to ``msg_id`` in this thread if ``conn``'s stream is free and that reply
        is the next frame, with no tensor data in the stream (tensors in shared-memory files are
        opened here); then give the stream back.

        Any other frame ends the wait here: the reader thread processes it,
        so no other call's callback and no peer's function runs in the
        caller's thread. The wait also ends at ``deadline``. This may be the
        main thread, where a signal handler can raise between any two
        steps: the reply is consumed whole in one step (a lost reply is the
        interrupted call's own), and a stream left owned by a session that
        ended is taken back by the reader thread (:meth:`_heal`).
        """
        data_wait = conn.data_wait
        assert data_wait is not None
        owner, stream, session = conn.owner, conn.stream, _Session()
        if owner.setdefault(OWNER, session) is not session:
            return  # the reader thread is reading: it hands the reply over
        reason, probe = None, False
        try:
            data_wait.pause()  # the reader thread sleeps through this reply
            taken: tuple[Kind, bytes, list[TensorDescriptor]] | bool = not stream.buffered
            while reply.outcome is None and not conn.closed:
                if taken is True:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return
                    conn.poller.poll(None if remaining is None else remaining * 1000)
                taken = stream.take_reply(msg_id)
                if taken is True:
                    continue
                if taken is False:
                    return
                kind, payload, descs = taken
                # Opened before the call is claimed: if that fails, dropping the connection fails the call.
                tensors, error = (
                    conn.receive_tensors(descs, self._cuda_count, self._me) if descs else ((), None)
                )
                entry = self._calls.claim(conn, msg_id)
                if entry is None:
                    continue  # timed out or failed meanwhile: reply is set
                if kind is Kind.ERROR:
                    reply.set(remote_failure(conn, entry, payload))
                elif error is not None:
                    reply.set(unplaceable(entry, error))
                else:
                    reply.set(Message(payload, tensors))
        except (FrameError, OSError, EOFError) as exc:
            reason, probe = self._read_failure(conn, exc), not isinstance(exc, FrameError)
        finally:
            if reason is not None:
                self._drop(conn, reason, probe)
            _end_session(conn, session)

    def _heal(self, conn: Connection) -> None:
        """Take the stream back from a session whose thread left :meth:`read_for` without giving it
        back (a signal handler raised at the wrong moment)."""
        session = conn.owner.get(OWNER)
        if not isinstance(session, _Session):
            return
        frame = sys._current_frames().get(session.thread)  # the documented way to see another thread
        while frame is not None:
            if frame.f_code is _READ_FOR_CODE and frame.f_locals.get("session") is session:
                return  # still reading (this session, not one of the thread's on another connection)
            frame = frame.f_back
        logger.debug("%s: taking back the stream of %s from an interrupted call", self._me, conn.peer.name)
        _end_session(conn, session)

    def hand_off(self, conn: Connection, token: object) -> None:
        """Give ``conn`` a new reader thread if ``token``'s holder is processing a frame."""
        with conn.role_lock:
            if conn.reader is not token or not conn.busy or conn.closed:
                return
            conn.reader = token = object()
            conn.owner[OWNER] = token  # the busy reader owns the stream: it passes to the new one
            conn.busy = 0
        self._spawn(self.read_loop, f"read-{conn.peer.name}", conn, token, True)
        if conn.outbox:
            conn.outbox.flush()  # replies the old reader kept; one kept after this look sends itself

    def busy(self) -> list[tuple[Hashable, int, object]]:
        """Each connection whose reader processes a frame now: the connection, the frame's job
        number and the reader's token (see :class:`.watch.Room`)."""
        found: list[tuple[Hashable, int, object]] = []
        for conn in self._connections():
            with conn.role_lock:
                if conn.busy:
                    found.append((conn, conn.busy, conn.reader))
        return found

    def relieve(self, holder: Hashable, token: object) -> None:
        """:meth:`hand_off` for the watch."""
        assert isinstance(holder, Connection)
        self.hand_off(holder, token)


def _end_session(conn: Connection, session: _Session) -> None:
    """Give the stream ``session`` owns back to the reader thread (safe to repeat)."""
    if conn.owner.get(OWNER) is session and conn.data_wait is not None:
        # Resumed before it is released, so no other session's pause is undone.
        conn.data_wait.resume(conn.stream.buffered > 0)
        conn.owner.pop(OWNER, None)


_READ_FOR_CODE: Final = Readers.read_for.__code__
