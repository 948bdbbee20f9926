"""Memory reused for large tensors received from a socket.

A fresh allocation of tens of MiB is paid for again on first touch: the
kernel faults in and zeroes every page while ``recv_into`` fills it (about
50 ms per 64 MiB here, as long as the copy itself). Tensors of at least
1 MiB that arrive over a socket are therefore placed in anonymous mappings
kept by :class:`ReceiveBuffers`: when the last view of such a tensor dies,
its mapping goes back to the pool, pages still resident, for the next
tensor of a fitting size. The pool is bounded (512 MiB of mappings alive,
in use or free, per process); past that, tensors get ordinary memory.
Tensors from the pool cannot be resized in place (``resize_``), as those
received through shared memory.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from typing import Final

import torch

__all__ = ["POOLED_MIN_BYTES", "RECEIVE_BUFFERS", "ReceiveBuffers"]

POOLED_MIN_BYTES: Final = 1 << 20
"""Received tensors of at least this many bytes are placed in pooled memory."""

_PAGE: Final = mmap.PAGESIZE
_MAX_BYTES: Final = 512 << 20


class ReceiveBuffers:
    """A bounded pool of anonymous mappings for received tensors (at most ``max_bytes`` alive)."""

    def __init__(self, max_bytes: int = _MAX_BYTES) -> None:
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self._max_bytes = max_bytes
        self._alive = 0  # bytes of the pool's mappings, free or viewed by a tensor

    @property
    def alive_bytes(self) -> int:
        """Bytes of the mappings the pool holds or lent out."""
        return self._alive

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor, in pooled memory when it is large enough."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes < POOLED_MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        buffer = self._take(-(-nbytes // _PAGE) * _PAGE)
        if buffer is None:
            return torch.empty(shape, dtype=dtype)
        window = (ctypes.c_char * nbytes).from_buffer(buffer)
        # When the last view of the tensor dies, so does the window: the mapping is free again.
        weakref.finalize(window, self._give_back, buffer)
        return torch.frombuffer(window, dtype=torch.uint8).view(dtype).reshape(shape)

    def _take(self, capacity: int) -> mmap.mmap | None:
        """A free mapping of ``capacity`` to twice that many bytes, or a new one while the pool has room."""
        with self._lock:
            fitting = [b for b in self._free if capacity <= len(b) <= 2 * capacity]
            if fitting:
                buffer = min(fitting, key=len)
                self._free.remove(buffer)
                return buffer
            while self._free and self._alive + capacity > self._max_bytes:
                # Unmapped when the collector frees it (a window's export may outlive the callback).
                self._alive -= len(self._free.pop(0))
            if self._alive + capacity > self._max_bytes:
                return None
            self._alive += capacity
        return mmap.mmap(-1, capacity)

    def _give_back(self, buffer: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buffer)


RECEIVE_BUFFERS: Final = ReceiveBuffers()
"""The process's pool, shared by every connection."""
