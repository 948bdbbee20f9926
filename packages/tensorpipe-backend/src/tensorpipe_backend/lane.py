"""A connection's lane: a second TCP connection to the same peer for the bytes of large tensors.

Between hosts one TCP stream is the limit of a large transfer (a raw Python
echo over a veth pair: 1.3 GB/s on one stream, 2.3-2.4 GB/s on two). The
worker that dialled a TCP connection to a peer of another host dials its
lane right after (on a thread of its own), with the same handshake; the
rank of its identity, sent negative with the local port of that connection
in it (:func:`lane_rank`), asks for a lane of exactly that connection. The
peer accepts one lane per connection it accepted, and the dialler confirms
with one byte. A lane found broken before a send is closed, and tensors
then go whole on the connection.
From then on each tensor of ``LANE_MIN_BYTES`` or more that is not in
shared memory is split: its first half (in whole pages) follows its frame,
the rest goes on the lane, both sent and received at once by two threads.
The tensor's descriptor says so. The lane carries nothing but those bytes,
in the order of the frames that announce them: a sender writes a frame
under the connection's send lock, and one reader at a time reads frames.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable
from typing import Final

from .transport import close_socket

__all__ = ["LANE_CONFIRM", "LANE_MIN_BYTES", "Lane", "lane_head", "lane_of", "lane_rank", "split_transfer"]

LANE_MIN_BYTES: Final = 8 << 20
"""Tensors of at least this many bytes are split over the connection and its lane."""
LANE_CONFIRM: Final = b"\x01"
"""What the dialler sends on its lane once accepted: from then on both ends use it."""
_PAGE_MASK: Final = ~0xFFF
_PORTS: Final = 1 << 16
_BROKEN: Final = select.POLLERR | select.POLLHUP | getattr(select, "POLLRDHUP", 0)


def lane_rank(rank: int, port: int) -> int:
    """The rank a worker of rank ``rank`` gives in the handshake of a lane for its connection from
    local port ``port`` (negative: ranks are not)."""
    return -1 - (rank * _PORTS + port)


def lane_of(rank: int) -> tuple[int, int] | None:
    """The worker's rank and the port of its connection if ``rank`` (from a handshake) asks for a
    lane, else ``None``."""
    return divmod(-1 - rank, _PORTS) if rank < 0 else None


def lane_head(nbytes: int) -> int:
    """How many bytes of a split tensor of ``nbytes`` follow its frame; the rest go on the lane."""
    return (nbytes // 2) & _PAGE_MASK


class Lane:
    """The lane of one connection: none until attached; claimed once, by the accepting end's handshake."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._claimed = False
        self._attached = threading.Event()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def sock(self) -> socket.socket | None:
        """The lane's socket once attached (``None`` before, and once closed)."""
        return self._sock

    @property
    def claimed(self) -> bool:
        """Whether a lane is attached or on its way (a frame may then use it before it is here)."""
        return self._claimed and not self._closed

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def claim(self) -> bool:
        """Reserve this lane for one handshake; ``False`` if another has it or it is closed."""
        with self._lock:
            if self._claimed or self._closed:
                return False
            self._claimed = True
            return True

    def attach(self, sock: socket.socket) -> None:
        """Use ``sock`` as the lane from now on (closed at once if the lane was closed meanwhile
        or already has one)."""
        with self._lock:
            if not self._closed and self._sock is None:
                self._sock = sock
                self._claimed = True
                self._attached.set()
                return
        close_socket(sock)

    def usable(self) -> socket.socket | None:
        """The lane's socket if attached and not broken; a broken one is closed (both ends then
        send whole tensors on the connection). Call with the connection's send lock held."""
        sock = self._sock
        if sock is None:
            return None
        poller = select.poll()
        poller.register(sock, _BROKEN)
        try:
            broken = bool(poller.poll(0))
        except (OSError, ValueError):
            broken = True
        if broken:
            self.close()
            return None
        return sock

    def wait(self, timeout: float) -> socket.socket | None:
        """The lane's socket, waiting at most ``timeout`` s for the attachment (the peer may have
        sent on its end before this end read the confirmation)."""
        self._attached.wait(timeout)
        return self._sock

    def close(self) -> None:
        """Shut the lane down (waking a thread blocked on it); it cannot be attached after."""
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            self._attached.set()
        if sock is not None:
            close_socket(sock)


def split_transfer(here: Callable[[], None], on_lane: Callable[[], None], lane: socket.socket) -> None:
    """Run ``on_lane`` on a new thread while ``here`` runs in this one; raise the first error.

    If ``here`` fails, ``lane`` is shut down (not closed: the thread may
    still use its descriptor) so that ``on_lane`` cannot block on it for
    ever.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            on_lane()
        except BaseException as exc:  # noqa: BLE001 - raised in the calling thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="lane", daemon=True)
    thread.start()
    try:
        here()
    except BaseException:
        with contextlib.suppress(OSError):
            lane.shutdown(socket.SHUT_RDWR)
        thread.join()
        raise
    thread.join()
    if errors:
        raise errors[0]
