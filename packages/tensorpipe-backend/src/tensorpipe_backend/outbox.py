"""A connection's outbox: frames whose sender does not wait for them to go out.

A reader thread that waited to send a reply would stop reading its
connection; were the peer's reader waiting likewise, neither socket would
ever drain again (both buffers full, both readers blocked in ``send``: two
workers calling each other at once deadlocked so). Readers therefore post
their replies here (those carrying up to 16 MiB inline, see
:mod:`tensorpipe_backend.requests`): :meth:`Outbox.post` waits neither for the connection's
``send_lock`` nor for the peer to read. What the socket does not take at
once stays queued, in order, and goes out before any other frame: a thread
that sends a frame of its own sends the queue first, and the connection's
writer thread (one per connection, asleep until woken) sends it as the peer
reads.

A signal handler can raise in the main thread between any two steps (after
any call), so there the queue changes in one step only (appending a whole
frame), the writer is woken in one step (releasing a lock), and no
``threading.Event`` or ``Condition`` is used (their Python-level
``__enter__`` can be cut off holding their lock): where the queue is not
empty, the main thread leaves the sending to the writer thread (see
:meth:`Outbox.send` and :meth:`Outbox.cleared`).
"""

from __future__ import annotations

import collections
import itertools
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Final

__all__ = ["DONTWAIT", "Outbox"]

DONTWAIT: Final = getattr(socket, "MSG_DONTWAIT", 0)
"""``send`` flag that never blocks (0 where the platform lacks it: sends there wait)."""
_TICK: Final = 1.0  # a wait for the peer or the writer checks this often whether the socket closed
_MAIN_WAIT: Final = 0.001  # the main thread's wait for the writer to empty the queue
_MAX_QUEUED: Final = 4096  # frames the main thread may queue before it waits for the writer
_JOIN_BYTES: Final = 1 << 16  # frames joined into one send, up to this size


def _batch(frames: collections.deque[bytes | memoryview]) -> int:
    """How many of the first frames to send in one call: small ones joined (one system call for
    many replies), a large one alone (joining it would copy it, as would each of its rests)."""
    queued = len(frames)
    if queued == 1:
        return 1  # the common case, without the loop
    count, size = 0, 0
    while count < queued:  # by index: readers may append meanwhile, which iterating forbids
        size += len(frames[count])
        if count and size > _JOIN_BYTES:
            break
        count += 1
    return count


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Outbox:
    """The frames waiting to go out on ``sock``, whose frames ``send_lock`` keeps whole.

    ``spawn(target, name)`` starts the writer thread named ``name`` (now);
    ``peer`` names the connection's peer (in the writer's name and errors).
    """

    def __init__(
        self,
        sock: socket.socket,
        send_lock: threading.Lock,
        peer: str,
        spawn: Callable[[Callable[[], None], str], None],
    ) -> None:
        self._sock = sock
        self._lock = send_lock
        self._peer = peer
        self._frames: collections.deque[bytes | memoryview] = (
            collections.deque()
        )  # the first may be a frame's rest
        self._closed = False
        self._kick = threading.Lock()  # released to wake the writer thread
        self._kick.acquire()
        self._writable = select.poll()  # used by send_lock's holder
        self._writable.register(sock, select.POLLOUT)
        spawn(self._write, f"write-{peer}")

    def __bool__(self) -> bool:
        return bool(self._frames)

    def __len__(self) -> int:
        return len(self._frames)

    def queued_bytes(self) -> int:
        """How many bytes wait to go out."""
        return sum(map(len, list(self._frames)))  # a copy: others may append meanwhile

    def close(self) -> None:
        """End the writer thread (the socket is closing); what is queued is dropped."""
        self._closed = True
        self._wake_writer()

    def post(self, frame: bytes, now: bool = True) -> None:
        """Queue the whole ``frame`` after the others and, if ``now``, :meth:`flush`; never waits."""
        self._frames.append(frame)
        if now:
            self.flush()

    def flush(self) -> None:
        """Send the queue as far as the socket takes it at once; the writer thread sends the rest.

        Never waits: if another thread holds ``send_lock``, it sends the
        queue before it lets go.
        """
        if _on_main_thread():
            if self._frames:
                self._wake_writer()
            return
        while self._frames:
            if not self._lock.acquire(blocking=False):
                return
            try:
                done = self._send(wait=False)
            except OSError:
                return  # broken: the connection's reader sees it and fails its calls
            finally:
                self._lock.release()
            if not done:
                self._wake_writer()
                return

    def send(self, frame: bytes) -> None:
        """Send the whole ``frame`` after the queue, waiting for the peer to read (hold ``send_lock``).

        The main thread sends it itself only where the queue is empty (one
        ``sendall``, as any frame); otherwise it queues it for the writer
        thread, and waits only while the queue is very long.
        """
        if not _on_main_thread():
            self._frames.append(frame)
            self._send(wait=True)
        elif not self._frames:
            self._sock.sendall(frame)
        else:
            self._frames.append(frame)
            while len(self._frames) > _MAX_QUEUED:
                self.wait_for_writer()
            self._wake_writer()

    def cleared(self) -> bool:
        """Whether the queue is sent, so that a frame of one's own may follow (hold ``send_lock``).

        Another thread sends it, waiting for the peer; the main thread only
        looks: if ``False``, let go of ``send_lock``, :meth:`wait_for_writer`
        and try again.
        """
        if not _on_main_thread():
            self._send(wait=True)
            return True
        return not self._frames

    def wait_for_writer(self) -> None:
        """Wake the writer thread and give it a moment; ``ConnectionError`` once closed."""
        if self._closed or self._sock.fileno() < 0:
            raise ConnectionError(f"the connection to {self._peer} is closed")
        self._wake_writer()
        time.sleep(_MAIN_WAIT)

    def _send(self, wait: bool) -> bool:
        """Send the queue, waiting for the peer to read if ``wait``; whether all of it went (hold
        ``send_lock``; never on the main thread)."""
        frames = self._frames
        send = self._sock.send
        while frames:
            count = _batch(frames)  # frames posted meanwhile go in a later round
            data = frames[0] if count == 1 else b"".join(itertools.islice(frames, count))
            view, sent = memoryview(data), 0
            try:
                while sent < len(view):
                    try:
                        sent += send(view[sent:], DONTWAIT)
                    except BlockingIOError:
                        if not wait:
                            break
                        self._wait_writable()
            finally:
                if sent:
                    for _ in range(count):
                        frames.popleft()
                    if sent < len(view):
                        frames.appendleft(view[sent:])  # the rest, not a copy of it
            if sent < len(view):
                return False
        return True

    def _wait_writable(self) -> None:
        """Wait until the socket takes more bytes; ``ConnectionError`` once it closed."""
        while not self._writable.poll(_TICK * 1000) or self._closed:
            if self._closed or self._sock.fileno() < 0:
                raise ConnectionError(f"the connection to {self._peer} closed")

    def _wake_writer(self) -> None:
        try:  # noqa: SIM105 - one call, no context manager: safe on the main thread
            self._kick.release()
        except RuntimeError:
            pass  # already woken

    def _write(self) -> None:
        """The writer thread: send the queue whenever woken (or each tick), until closed."""
        queued = False
        while True:
            if not queued:
                self._kick.acquire(timeout=_TICK)
            if self._closed or self._sock.fileno() < 0:
                return
            if not self._frames:
                queued = False
                continue
            with self._lock:
                try:
                    self._send(wait=True)
                except OSError:
                    return  # broken or closed: the connection's reader sees it
            # A frame posted while this thread held the lock was left to it (flush could not
            # take the lock, and wakes nobody): send it now, not at the next tick.
            queued = bool(self._frames)
