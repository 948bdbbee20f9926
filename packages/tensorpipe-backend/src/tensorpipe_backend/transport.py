"""How bytes move between workers: TCP and Unix sockets, and whether a peer can share memory.

Workers listen on TCP at the address that routes to the rendezvous host and,
on Linux, on a Unix socket with a random name in the abstract namespace for
peers of the same host. TCP sockets get keepalive and ``TCP_USER_TIMEOUT``
(a dead peer is noticed in about four seconds); a Unix socket closes at once
when its peer dies. Large tensors between workers of one host and user go
through shared-memory files (:mod:`tensorpipe_backend.shm`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import select
import socket
import struct
import sys
import weakref
from typing import Final

from .group import WorkerRecord
from .shm import SharedFiles

logger = logging.getLogger(__name__)

__all__ = [
    "DataWait",
    "close_socket",
    "dial_local",
    "local_listener",
    "shared_files",
    "tune",
]

_CREDENTIALS: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
_KEEPALIVE: Final = {"TCP_KEEPIDLE": 1, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 4000}


def local_listener() -> socket.socket | None:
    """A listening Unix socket with a random name in the abstract namespace (Linux), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(b"\0tpb-" + secrets.token_hex(16).encode())
        listener.listen(64)
    except OSError as exc:
        logger.debug("no Unix socket for peers on this host: %s", exc)
        listener.close()
        return None
    listener.settimeout(0.2)
    return listener


def dial_local(mine: WorkerRecord | None, record: WorkerRecord, timeout: float) -> socket.socket | None:
    """A Unix socket from the worker of ``mine`` to the peer of ``record`` on this host; ``None``
    when either has none, they are on different hosts, or it cannot be reached."""
    if not record.local_socket or mine is None or not mine.shm_host or record.shm_host != mine.shm_host:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(b"\0" + record.local_socket.encode())
    except OSError as exc:  # e.g. another network namespace: TCP it is
        logger.debug("%s: no Unix socket to %s (%s); using TCP", mine.name, record.name, exc)
        sock.close()
        return None
    return sock


def tune(sock: socket.socket) -> None:
    """Disable Nagle and enable keepalive on a TCP socket (a Unix socket needs neither)."""
    if sock.family == socket.AF_UNIX:
        return  # no TCP options; a peer's death closes the socket at once
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in _KEEPALIVE.items():
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def close_socket(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (waking a thread blocked on it) and close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def shared_files(mine: WorkerRecord | None, record: WorkerRecord, sock: socket.socket) -> SharedFiles | None:
    """Shared-memory files for an authenticated peer on this host; ``None`` for other peers."""
    if mine is None or not mine.shm_host or record.shm_host != mine.shm_host:
        return None
    if sock.family == socket.AF_UNIX:
        # The kernel vouches for the peer: same host, and SO_PEERCRED gives its user.
        _, uid, _ = _CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        )
        return SharedFiles() if uid == os.geteuid() else None
    try:
        local, remote = sock.getsockname()[0], sock.getpeername()[0]
    except OSError:
        return None
    if local != remote and not ipaddress.ip_address(remote).is_loopback:
        return None
    return SharedFiles()


class DataWait:
    """Where a connection's reader thread waits for data: an epoll set of the socket and a nudge.

    A thread that reads its own reply (``TensorPipeAgent.send_wait``)
    pauses the socket's registration, so that the reader thread sleeps
    through that reply, and resumes it when done; resuming wakes the reader
    thread if the socket has data, the nudge if only the buffer has some.
    Linux only (``supported``); elsewhere replies are always read by the
    reader thread. Its descriptors live as long as the connection object.
    """

    supported: Final = hasattr(select, "epoll") and hasattr(os, "eventfd")

    def __init__(self, sock: socket.socket) -> None:
        self._fd = sock.fileno()
        self._nudge = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Closed with this object, when no thread can use them any more (the epoll set closes itself).
        weakref.finalize(self, os.close, self._nudge)
        self._epoll = select.epoll()
        self._epoll.register(self._fd, select.EPOLLIN)
        self._epoll.register(self._nudge, select.EPOLLIN)

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for data or a nudge; whether one came (``False`` once closed)."""
        try:
            events = self._epoll.poll(timeout)
            for fd, _ in events:
                if fd == self._nudge:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._nudge)
        except (OSError, ValueError):  # closed under it
            return False
        return bool(events)

    def pause(self) -> None:
        """Stop waking the reader thread for the socket's data (a caller reads its reply)."""
        with contextlib.suppress(OSError, ValueError):
            self._epoll.modify(self._fd, 0)

    def resume(self, nudge: bool) -> None:
        """Wake the reader thread for the socket's data again, and at once if ``nudge``."""
        with contextlib.suppress(OSError, ValueError):
            self._epoll.modify(self._fd, select.EPOLLIN)
            if nudge:
                os.eventfd_write(self._nudge, 1)
