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
shuts down or when the process exits.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import stat
import threading
from typing import Final

import torch

from .wire import SHM_TOKEN_BYTES, FrameError

__all__ = ["SHM_MIN_BYTES", "MissingFileError", "SharedFiles", "host_identity", "open_tensor"]

SHM_MIN_BYTES: Final = 1 << 20
"""Tensors of at least this many bytes go through shared memory between workers of one host."""

_DIR: Final = "/dev/shm"
_PREFIX: Final = "tpb-"

_live_lock = threading.Lock()
_live: set[str] = set()


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


class SharedFiles:
    """The files one connection has sent and its peer may not have taken yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: list[str] = []

    def write(self, data: memoryview) -> bytes:
        """Put ``data`` in a fresh shared-memory file; its token names it to the peer."""
        self._prune()
        token = secrets.token_bytes(SHM_TOKEN_BYTES)
        path = _path(token)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with _live_lock:
            _live.add(path)
        try:
            os.ftruncate(fd, len(data))
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
        return token

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
        """Unlink every file the peer did not take."""
        with self._lock:
            sent, self._sent = self._sent, []
        for path in sent:
            _unlink(path)


def open_tensor(
    token: bytes, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, unlink: bool
) -> torch.Tensor:
    """The tensor a peer of this host put in the file named by ``token``; ``unlink`` removes the file.

    ``MissingFileError`` when the file is gone; ``FrameError`` when it is not
    a regular file of this user, or does not hold exactly ``nbytes`` bytes.
    """
    path = _path(token)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise MissingFileError(f"the shared-memory tensor {path} is gone ({exc})") from exc
    except OSError as exc:
        raise FrameError(f"cannot open the shared-memory tensor {path}: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise FrameError(f"{path} is not a regular file of this user; refusing it")
        if info.st_size != nbytes:
            raise FrameError(f"{path} holds {info.st_size} bytes, the frame announced {nbytes}")
        if unlink:
            _unlink(path)
        memory = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).reshape(shape)


@atexit.register
def _unlink_all() -> None:
    with _live_lock:
        paths = list(_live)
    for path in paths:
        _unlink(path)
