"""Large tensors between workers of one host, through files in ``/dev/shm``.

Only used on a connection whose peer authenticated and published the same
host identity (boot id, ``/dev/shm`` device and inode, user id): the sender
writes a tensor's bytes into a fresh file ``/dev/shm/tpb-<32 hex>`` (mode
0600, created exclusively) and sends only the 16-byte token of its name; the
receiver opens it without following links, checks that it is a regular
file of its own user with exactly the announced size and maps it as the
tensor's memory (freed when the tensor is), unlinking it at once. A sender
also unlinks a request's files when the call ends (reply or timeout), and
every file its peer did not take when the connection closes, when the agent
shuts down or when the process exits. A token starts with its sender's pid
and pid namespace, so the files of a process killed before it could clean up
are swept when a peer's connection closes and when a process first shares
memory: files of this user whose sender is gone are unlinked.

Files are pooled per connection and direction, so that their pages are
touched once, not per message: the sender keeps each file mapped and writes
the next tensor of a fitting size into one its peer has released; the peer
keeps the file mapped (it was unlinked when first opened) and makes each
tensor a view of it. A file ends in a status page: the sender sets its first byte when it
hands the file over, and the receiver clears it when the last view of the
tensor dies (a memory write, safe from any thread). When no pooled file is
free and the pool is full, a tensor goes in a file of its own.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import secrets
import stat
import struct
import threading
import weakref
from typing import Final

import torch

from .wire import SHM_TOKEN_BYTES, FrameError

__all__ = [
    "SHM_MIN_BYTES",
    "MissingFileError",
    "SharedFiles",
    "host_identity",
    "open_tensor",
    "sweep_dead_senders",
]

SHM_MIN_BYTES: Final = 1 << 20
"""Tensors of at least this many bytes go through shared memory between workers of one host."""

_DIR: Final = "/dev/shm"
_PREFIX: Final = "tpb-"
_PAGE: Final = mmap.PAGESIZE
_POOL_FILES: Final = 8
_POOL_BYTES: Final = 1 << 30
_FLAGS: Final = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)

_SENDER: Final = struct.Struct("!II")  # the token's first bytes: sender pid, pid namespace tag

_live_lock = threading.Lock()
_live: set[str] = set()
_swept_once = False


def _pid_namespace() -> int:
    """A tag of this process's pid namespace (0 when unknown: then nothing is swept)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def _new_token() -> bytes:
    return _SENDER.pack(os.getpid(), _pid_namespace()) + secrets.token_bytes(SHM_TOKEN_BYTES - _SENDER.size)


def _sender_gone(name: str, namespace: int) -> bool:
    """Whether the file ``name`` (``tpb-<token hex>``) was made by a process of this pid namespace that is gone."""
    try:
        pid, tag = _SENDER.unpack(bytes.fromhex(name[len(_PREFIX) :])[: _SENDER.size])
    except ValueError:
        return False
    if tag != namespace or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def sweep_dead_senders() -> list[str]:
    """Unlink this user's shared-memory files whose sending process is gone; the names unlinked."""
    namespace = _pid_namespace()
    if not namespace:
        return []
    swept = []
    uid = os.geteuid()
    try:
        names = [n for n in os.listdir(_DIR) if n.startswith(_PREFIX)]
    except OSError:
        return []
    for name in names:
        path = f"{_DIR}/{name}"
        try:
            if os.lstat(path).st_uid != uid or not _sender_gone(name, namespace):
                continue
            os.unlink(path)
        except OSError:
            continue
        swept.append(name)
    return swept


def host_identity() -> str:
    """What two workers must share to exchange tensors through ``/dev/shm``; empty when unusable."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
        info = os.stat(_DIR)
    except OSError:
        return ""
    if not stat.S_ISDIR(info.st_mode) or not os.access(_DIR, os.W_OK):
        return ""
    return f"{boot_id}:{info.st_dev}:{info.st_ino}:{os.geteuid()}"


class MissingFileError(LookupError):
    """The file of a token is gone: its sender unlinked it (a call that timed out), not an attack."""


def _path(token: bytes) -> str:
    if len(token) != SHM_TOKEN_BYTES:
        raise FrameError(f"a shared-memory token has {SHM_TOKEN_BYTES} bytes, got {len(token)}")
    return f"{_DIR}/{_PREFIX}{token.hex()}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return
    with _live_lock:
        _live.discard(path)


class _Pooled:
    """A pooled file on the sending side: kept mapped, data first, status page last."""

    __slots__ = ("bytes", "capacity", "memory", "path", "token")

    def __init__(self, token: bytes, path: str, capacity: int, memory: mmap.mmap) -> None:
        self.token = token
        self.path = path
        self.capacity = capacity
        self.memory = memory
        self.bytes = torch.frombuffer(memory, dtype=torch.uint8)

    @property
    def free(self) -> bool:
        return self.memory[self.capacity] == 0


class _Received:
    """A pooled file of the peer, open on the receiving side."""

    __slots__ = ("capacity", "memory")

    def __init__(self, memory: mmap.mmap, capacity: int) -> None:
        self.memory = memory
        self.capacity = capacity


def _copy(address: int, data: memoryview) -> None:
    """Copy ``data`` (writable, as :func:`~tensorpipe_backend.wire.tensor_bytes` makes it) to
    ``address`` on this thread, without the GIL.

    Not ``Tensor.copy_``: it splits a copy over torch's intra-op threads,
    whose hand-offs cost milliseconds per MiB on a loaded host (7 ms for
    1 MiB against 0.13 ms here, two cores shared with other processes).
    """
    ctypes.memmove(address, (ctypes.c_char * len(data)).from_buffer(data), len(data))


def _release(memory: mmap.mmap, capacity: int) -> None:
    memory[capacity] = 0


def _create(token: bytes, size: int) -> tuple[str, int]:
    path = _path(token)
    fd = os.open(path, _FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
    with _live_lock:
        _live.add(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return path, fd


class SharedFiles:
    """The shared-memory files of one connection: those sent (pooled or not) and those received."""

    def __init__(self) -> None:
        global _swept_once
        if not _swept_once:
            _swept_once = True
            sweep_dead_senders()
        self._lock = threading.Lock()
        self._sent: list[str] = []
        self._pool: list[_Pooled] = []
        self._received: dict[bytes, _Received] = {}
        self._closed = False

    def write(self, data: memoryview) -> tuple[bytes, bool]:
        """Put ``data`` in shared memory: its token names the file to the peer, and whether it is pooled."""
        pooled = self._pooled(len(data))
        if pooled is not None:
            _copy(pooled.bytes.data_ptr(), data)
            return pooled.token, True
        self._prune()
        token = _new_token()
        path, fd = _create(token, len(data))
        try:
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], written)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        with self._lock:
            self._sent.append(path)
        return token, False

    def _pooled(self, nbytes: int) -> _Pooled | None:
        """A released pooled file for ``nbytes`` bytes, marked in use; a new one while the pool has room."""
        capacity = -(-nbytes // _PAGE) * _PAGE
        with self._lock:
            if self._closed:
                return None
            for pooled in self._pool:
                if capacity <= pooled.capacity <= 2 * capacity and pooled.free:
                    pooled.memory[pooled.capacity] = 1
                    return pooled
            if len(self._pool) >= _POOL_FILES or sum(p.capacity for p in self._pool) + capacity > _POOL_BYTES:
                return None
            token = _new_token()
            path, fd = _create(token, capacity + _PAGE)
            try:
                memory = mmap.mmap(fd, capacity + _PAGE)
            finally:
                os.close(fd)
            pooled = _Pooled(token, path, capacity, memory)
            memory[capacity] = 1
            self._pool.append(pooled)
            self._sent.append(path)
            return pooled

    def receive(
        self, token: bytes, pooled: bool, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
    ) -> torch.Tensor:
        """The tensor the peer put in the file of ``token`` (see :func:`open_tensor` for the errors)."""
        if not pooled:
            return open_tensor(token, dtype, shape, nbytes, unlink=True)
        with self._lock:
            entry = self._received.get(token)
            if entry is None:
                entry = self._received[token] = self._open_pooled(token)
        if nbytes > entry.capacity:
            raise FrameError(f"{nbytes} bytes announced in a pooled file of {entry.capacity}")
        window = (ctypes.c_char * nbytes).from_buffer(entry.memory)
        # When the last view of the tensor dies, so does the window: the file is free again.
        weakref.finalize(window, _release, entry.memory, entry.capacity)
        return torch.frombuffer(window, dtype=torch.uint8).view(dtype).reshape(shape)

    @staticmethod
    def _open_pooled(token: bytes) -> _Received:
        path = _path(token)
        fd = _open_checked(path)
        try:
            size = os.fstat(fd).st_size
            if size < 2 * _PAGE or size % _PAGE:
                raise FrameError(f"{path} holds {size} bytes, not a pooled file")
            _unlink(path)
            memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        return _Received(memory, size - _PAGE)

    def release(self, tokens: list[bytes]) -> None:
        """Unlink the files of ``tokens`` (those of a request, once its reply came)."""
        if not tokens:
            return
        paths = {_path(token) for token in tokens}
        with self._lock:
            self._sent = [path for path in self._sent if path not in paths]
        for path in paths:
            _unlink(path)

    def _prune(self) -> None:
        """Forget files the peer has taken (it unlinks each one it opens)."""
        with self._lock:
            taken = [path for path in self._sent if not os.path.lexists(path)]
            if not taken:
                return
            self._sent = [path for path in self._sent if path not in taken]
        with _live_lock:
            _live.difference_update(taken)

    def close(self) -> None:
        """Unlink every file the peer did not take; let go of the pooled files."""
        with self._lock:
            self._closed = True
            sent, self._sent = self._sent, []
            pool, self._pool = self._pool, []
            received, self._received = self._received, {}
        for path in sent:
            _unlink(path)
        del pool, received  # the mappings go with the last tensor that views them
        sweep_dead_senders()  # the peer may have been killed with files not yet taken


def open_tensor(
    token: bytes, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, unlink: bool
) -> torch.Tensor:
    """The tensor a peer of this host put in the file named by ``token``; ``unlink`` removes the file.

    ``MissingFileError`` when the file is gone; ``FrameError`` when it is not
    a regular file of this user, or does not hold exactly ``nbytes`` bytes.
    """
    path = _path(token)
    fd = _open_checked(path)
    try:
        info = os.fstat(fd)
        if info.st_size != nbytes:
            raise FrameError(f"{path} holds {info.st_size} bytes, the frame announced {nbytes}")
        if unlink:
            _unlink(path)
        memory = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).reshape(shape)


def _open_checked(path: str) -> int:
    """Open ``path``, a regular file of this user; ``MissingFileError`` when it is gone."""
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError as exc:
        raise MissingFileError(f"the shared-memory tensor {path} is gone ({exc})") from exc
    except OSError as exc:
        raise FrameError(f"cannot open the shared-memory tensor {path}: {exc}") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise FrameError(f"{path} is not a regular file of this user; refusing it")
    return fd


@atexit.register
def _unlink_all() -> None:
    with _live_lock:
        paths = list(_live)
    for path in paths:
        _unlink(path)
