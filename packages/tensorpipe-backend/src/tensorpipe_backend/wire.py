"""The frame format between two authenticated agents.

A frame is a fixed 28-byte header, a block of tensor descriptors, the pickled
payload (bytes the RPC layer produced; this module never unpickles) and the
raw bytes of each tensor, in order::

    header      magic "TPB1", kind, message id, payload length,
                tensor count, descriptor block length
    descriptors per tensor: dtype, target device, ndim, flags, byte count, shape
                and, with the shared-memory flag, a 16-byte file token
    payload     payload-length bytes
    tensor data each tensor's bytes, C-contiguous

Tensors are sent from their own memory (no copy for contiguous CPU tensors)
and received straight into tensors allocated from their descriptors. A
tensor flagged as shared memory has no bytes in the frame: its data is in a
file of ``/dev/shm`` named by its token (see :mod:`tensorpipe_backend.shm`). Every
length and count is checked against the bounds below before anything is
allocated, so a corrupt or hostile frame is rejected with :class:`FrameError`;
and memory for a payload is taken as its bytes arrive (a tensor's pages, as
its bytes are written), so a header announcing more than is sent costs
nothing.
"""

from __future__ import annotations

import ctypes
import enum
import math
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, cast

import torch

__all__ = [
    "HEADER",
    "MAX_DESCRIPTOR_BYTES",
    "MAX_MESSAGE_TENSOR_BYTES",
    "MAX_NDIM",
    "MAX_PAYLOAD_BYTES",
    "MAX_TENSORS",
    "SHM_TOKEN_BYTES",
    "FrameError",
    "FrameHeader",
    "FrameReader",
    "Kind",
    "TensorDescriptor",
    "decode_descriptors",
    "decode_header",
    "encode_descriptors",
    "encode_header",
    "recv_exact",
    "recv_into",
    "small_frame",
    "tensor_bytes",
]

MAGIC: Final = b"TPB1"
HEADER: Final = struct.Struct("!4sB3xQIII")
"""magic, kind, message id, payload length, tensor count, descriptor block length."""

_DESCRIPTOR: Final = struct.Struct("!BBhBB2xQ")
_DIM: Final = struct.Struct("!q")

MAX_PAYLOAD_BYTES: Final = 1 << 31
"""Largest pickled payload of one frame (2 GiB)."""
MAX_TENSORS: Final = 1 << 16
"""Most tensors one frame may carry."""
MAX_NDIM: Final = 64
"""Most dimensions of one tensor."""
MAX_DESCRIPTOR_BYTES: Final = MAX_TENSORS * (_DESCRIPTOR.size + 8 * 8)
"""Largest descriptor block (room for every tensor with eight dimensions)."""
MAX_MESSAGE_TENSOR_BYTES: Final = 1 << 40
"""Largest total of tensor bytes in one frame (1 TiB)."""

_SEND_CHUNK: Final = 1 << 23
_PEEK_PAYLOAD: Final = 1 << 16
_PEEK_FLAGS: Final = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)
_READ_BUFFER: Final = 1 << 18
_GROW_CHUNK: Final = 1 << 20


class Kind(enum.IntEnum):
    """What a frame carries."""

    REQUEST = 1
    REPLY = 2
    ERROR = 3
    PING = 4
    PONG = 5
    GOODBYE = 6
    GROUP = 7
    """A static group's round (see :mod:`tensorpipe_backend.rounds`): the id is the round's number."""


_KINDS: Final = {int(kind): kind for kind in Kind}


class FrameError(ValueError):
    """A frame that breaks the format or its bounds; the connection must be closed."""


class FrameHeader(NamedTuple):
    """A decoded header."""

    kind: Kind
    msg_id: int
    payload_len: int
    tensor_count: int
    descriptors_len: int


@dataclass(frozen=True)
class TensorDescriptor:
    """How to allocate a received tensor and where it must land."""

    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...]
    nbytes: int
    requires_grad: bool = False
    shm_token: bytes = b""
    """Empty, or the ``SHM_TOKEN_BYTES`` naming the shared-memory file that holds the data."""
    shm_pooled: bool = False
    """Whether that file is one of the sender's pooled files (kept and reused), not one of its own."""
    lane: bool = False
    """Whether the data is split: the first ``lane.lane_head`` bytes follow the frame, the rest come
    on the connection's lane (see :mod:`tensorpipe_backend.lane`)."""


def _dtype_table() -> tuple[torch.dtype, ...]:
    names = [
        *("float32", "float64", "float16", "bfloat16", "complex64", "complex128"),
        *("uint8", "int8", "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64"),
        *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "complex32"),
    ]
    found = (getattr(torch, name, None) for name in names)
    return tuple(dtype for dtype in found if isinstance(dtype, torch.dtype))


# Codes are positions in this table; new dtypes go at the end of the names.
_DTYPES: Final = _dtype_table()
_DTYPE_CODES: Final = {dtype: code for code, dtype in enumerate(_DTYPES)}
_DEVICE_TYPES: Final = ("cpu", "cuda")
_REQUIRES_GRAD: Final = 1
_SHARED_MEMORY: Final = 2
_POOLED: Final = 4
_LANE: Final = 8
_FLAGS: Final = _REQUIRES_GRAD | _SHARED_MEMORY | _POOLED | _LANE
SHM_TOKEN_BYTES: Final = 16
"""Length of the token naming a tensor's shared-memory file."""


def device_index(device: torch.device) -> int:
    """``device``'s index, ``-1`` when it has none (``cpu``, or ``cuda`` meaning the current one)."""
    index = cast("int | None", device.index)
    return -1 if index is None else index


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype``; ``TypeError`` for dtypes that cannot be sent."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"tensor dtype {dtype} cannot be sent over RPC; convert it, e.g. with .float()")
    return code


def encode_header(
    kind: Kind, msg_id: int, payload_len: int, tensor_count: int, descriptors_len: int
) -> bytes:
    """Pack a header; values out of bounds raise :class:`FrameError`."""
    _check_sizes(payload_len, tensor_count, descriptors_len)
    if not 0 <= msg_id < 1 << 64:
        raise FrameError(f"message id {msg_id} does not fit in 64 bits")
    return HEADER.pack(MAGIC, int(kind), msg_id, payload_len, tensor_count, descriptors_len)


def _check_sizes(payload_len: int, tensor_count: int, descriptors_len: int) -> None:
    if payload_len > MAX_PAYLOAD_BYTES:
        raise FrameError(f"payload of {payload_len} bytes exceeds the limit of {MAX_PAYLOAD_BYTES}")
    if tensor_count > MAX_TENSORS:
        raise FrameError(f"{tensor_count} tensors exceed the limit of {MAX_TENSORS} per message")
    if descriptors_len > MAX_DESCRIPTOR_BYTES:
        raise FrameError(f"descriptor block of {descriptors_len} bytes exceeds {MAX_DESCRIPTOR_BYTES}")


def decode_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Unpack and check a header of exactly ``HEADER.size`` bytes."""
    if len(data) != HEADER.size:
        raise FrameError(f"a header has {HEADER.size} bytes, got {len(data)}")
    return _checked_header(*HEADER.unpack(data))


def _checked_header(
    magic: bytes, kind: int, msg_id: int, payload_len: int, tensor_count: int, descriptors_len: int
) -> FrameHeader:
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}: the peer does not speak this protocol")
    frame_kind = _KINDS.get(kind)
    if frame_kind is None:
        raise FrameError(f"unknown frame kind {kind}")
    if tensor_count == 0:
        if descriptors_len != 0:
            raise FrameError(f"descriptor block of {descriptors_len} bytes for no tensors")
        if payload_len > MAX_PAYLOAD_BYTES:
            _check_sizes(payload_len, tensor_count, descriptors_len)
        return FrameHeader(frame_kind, msg_id, payload_len, 0, 0)
    _check_sizes(payload_len, tensor_count, descriptors_len)
    if frame_kind is not Kind.REQUEST and frame_kind is not Kind.REPLY:
        raise FrameError(f"a {frame_kind.name} frame carries no tensors, got {tensor_count}")
    return FrameHeader(frame_kind, msg_id, payload_len, tensor_count, descriptors_len)


def small_frame(kind: Kind, msg_id: int, payload: bytes) -> bytes:
    """A whole frame without tensors; ``msg_id`` must fit in 64 bits and ``payload`` be at most
    ``MAX_PAYLOAD_BYTES`` long (the caller knows it does)."""
    return HEADER.pack(MAGIC, kind, msg_id, len(payload), 0, 0) + payload


def encode_descriptors(descriptors: Sequence[TensorDescriptor]) -> bytes:
    """Pack the descriptor block of a frame."""
    parts: list[bytes] = []
    for desc in descriptors:
        if desc.device.type not in _DEVICE_TYPES:
            raise TypeError(f"tensors can land on cpu or cuda devices only, not {desc.device}")
        if len(desc.shape) > MAX_NDIM:
            raise FrameError(f"a tensor of {len(desc.shape)} dimensions exceeds the limit of {MAX_NDIM}")
        index = device_index(desc.device)
        flags = _REQUIRES_GRAD if desc.requires_grad else 0
        if desc.shm_token:
            if len(desc.shm_token) != SHM_TOKEN_BYTES:
                raise FrameError(
                    f"a shared-memory token has {SHM_TOKEN_BYTES} bytes, got {len(desc.shm_token)}"
                )
            flags |= _SHARED_MEMORY | (_POOLED if desc.shm_pooled else 0)
        elif desc.lane:
            flags |= _LANE
        parts.append(
            _DESCRIPTOR.pack(
                dtype_code(desc.dtype),
                _DEVICE_TYPES.index(desc.device.type),
                index,
                len(desc.shape),
                flags,
                desc.nbytes,
            )
        )
        parts.extend(_DIM.pack(dim) for dim in desc.shape)
        if desc.shm_token:
            parts.append(desc.shm_token)
    return b"".join(parts)


def decode_descriptors(data: bytes | bytearray | memoryview, count: int) -> list[TensorDescriptor]:
    """Unpack ``count`` descriptors filling ``data`` exactly, checking every field."""
    view = memoryview(data)
    offset = 0
    total = 0
    out: list[TensorDescriptor] = []
    for i in range(count):
        if offset + _DESCRIPTOR.size > len(view):
            raise FrameError(f"descriptor {i} is truncated")
        code, device_type, index, ndim, flags, nbytes = _DESCRIPTOR.unpack_from(view, offset)
        offset += _DESCRIPTOR.size
        if code >= len(_DTYPES):
            raise FrameError(f"descriptor {i}: unknown dtype code {code}")
        if device_type >= len(_DEVICE_TYPES):
            raise FrameError(f"descriptor {i}: unknown device type {device_type}")
        if ndim > MAX_NDIM:
            raise FrameError(f"descriptor {i}: {ndim} dimensions exceed the limit of {MAX_NDIM}")
        if flags & ~_FLAGS:
            raise FrameError(f"descriptor {i}: unknown flags {flags:#x}")
        if offset + ndim * _DIM.size > len(view):
            raise FrameError(f"descriptor {i}: shape is truncated")
        shape = tuple(_DIM.unpack_from(view, offset + k * _DIM.size)[0] for k in range(ndim))
        offset += ndim * _DIM.size
        token = b""
        if flags & _SHARED_MEMORY:
            if offset + SHM_TOKEN_BYTES > len(view):
                raise FrameError(f"descriptor {i}: shared-memory token is truncated")
            token = bytes(view[offset : offset + SHM_TOKEN_BYTES])
            offset += SHM_TOKEN_BYTES
        if any(dim < 0 for dim in shape):
            raise FrameError(f"descriptor {i}: negative dimension in shape {shape}")
        dtype = _DTYPES[code]
        expected = math.prod(shape) * dtype.itemsize
        if nbytes != expected:
            raise FrameError(f"descriptor {i}: {nbytes} bytes do not match shape {shape} of {dtype}")
        total += nbytes
        if total > MAX_MESSAGE_TENSOR_BYTES:
            raise FrameError(f"tensors of more than {MAX_MESSAGE_TENSOR_BYTES} bytes in one message")
        kind = _DEVICE_TYPES[device_type]
        if kind == "cpu" and index != -1:
            raise FrameError(f"descriptor {i}: cpu device with index {index}")
        if kind == "cuda" and index < 0:
            raise FrameError(f"descriptor {i}: cuda device without an index")
        device = torch.device(kind) if kind == "cpu" else torch.device(kind, index)
        requires_grad = bool(flags & _REQUIRES_GRAD)
        if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            raise FrameError(f"descriptor {i}: requires_grad on a tensor of {dtype}")
        if token and nbytes == 0:
            raise FrameError(f"descriptor {i}: an empty tensor in shared memory")
        if flags & _POOLED and not token:
            raise FrameError(f"descriptor {i}: a pooled file flag without a shared-memory token")
        if flags & _LANE and token:
            raise FrameError(f"descriptor {i}: a tensor both in shared memory and on the lane")
        out.append(
            TensorDescriptor(
                dtype, device, shape, nbytes, requires_grad, token, bool(flags & _POOLED), bool(flags & _LANE)
            )
        )
    if offset != len(view):
        raise FrameError(f"descriptor block has {len(view) - offset} bytes left over")
    return out


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying; keep ``tensor`` alive while used."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``EOFError`` when the peer closes first."""
    received = 0
    size = len(view)
    while received < size:
        count = sock.recv_into(view[received:], size - received)
        if count == 0:
            raise EOFError(f"connection closed after {received} of {size} bytes")
        received += count


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    """Read exactly ``size`` bytes from ``sock``."""
    buffer = bytearray(size)
    recv_into(sock, memoryview(buffer))
    return buffer


class FrameReader:
    """Reads frames from a socket through one buffer, so that one ``recv`` may bring many small frames.

    Tensor data is copied out of the buffer as far as it is there, and the
    rest received straight into the tensor's memory. ``received`` counts the
    bytes taken from the socket: it moves while a long frame arrives, which
    shows the peer alive (:mod:`tensorpipe_backend.liveness`).
    """

    def __init__(self, sock: socket.socket, size: int = _READ_BUFFER) -> None:
        self._sock = sock
        self.received: int = 0
        self._buffer = bytearray(size)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        self._peek = memoryview(bytearray(HEADER.size + _PEEK_PAYLOAD))

    def has_frame(self) -> bool:
        """Whether a whole header, descriptor block and payload are buffered (no ``recv`` needed)."""
        available = self._end - self._start
        if available < HEADER.size:
            return False
        _, _, _, payload_len, _, descriptors_len = HEADER.unpack_from(self._view, self._start)
        return bool(available >= HEADER.size + descriptors_len + payload_len)

    @property
    def buffered(self) -> int:
        """How many received bytes wait in the buffer."""
        return self._end - self._start

    def take_reply(self, msg_id: int) -> tuple[Kind, bytes, list[TensorDescriptor]] | bool:
        """Consume the next frame if it is the REPLY or ERROR frame ``msg_id`` with no tensor data
        in the stream (its tensors, if any, all in shared-memory files), and return its kind,
        payload and descriptors; ``True`` while it has not wholly arrived, ``False`` when another
        frame (or a longer one) comes first. Never waits.

        Unlike :meth:`read_frame`, nothing is consumed before the whole frame
        is at hand, and it is consumed in one step (one store, or one
        ``recv``): an exception raised in between by a signal handler loses
        at most that frame, and the stream stays whole.
        """
        if self._end > self._start:  # buffered bytes come first: only a whole frame here
            view, offset, available = self._view, self._start, self._end - self._start
        else:
            try:
                available = self._sock.recv_into(self._peek, len(self._peek), _PEEK_FLAGS)
            except BlockingIOError:
                return True
            if available == 0:
                raise EOFError("connection closed")
            view, offset = self._peek, 0
        if available < HEADER.size:
            return view is self._peek
        header = _checked_header(*HEADER.unpack_from(view, offset))
        length = HEADER.size + header.descriptors_len + header.payload_len
        if (
            header.msg_id != msg_id
            or (header.kind is not Kind.REPLY and header.kind is not Kind.ERROR)
            or length > len(self._peek)
        ):
            return False
        if available < length:
            return view is self._peek
        start = offset + HEADER.size
        descriptors: list[TensorDescriptor] = []
        if header.tensor_count:
            block = view[start : start + header.descriptors_len]
            descriptors = decode_descriptors(block, header.tensor_count)
            if not all(desc.shm_token for desc in descriptors):
                return False  # tensor data follows in the stream: the reader thread takes it
            start += header.descriptors_len
        payload = bytes(view[start : start + header.payload_len])
        if view is self._view:
            self._start = offset + length
        elif self._sock.recv_into(self._peek, length, socket.MSG_WAITALL) != length:
            raise EOFError("connection closed within a frame")
        else:
            self.received += length
        return header.kind, payload, descriptors

    def read_frame(self) -> tuple[FrameHeader, list[TensorDescriptor], bytes]:
        """The next frame's header, descriptors and payload; its tensor data follows (see ``read_into``)."""
        if self._end - self._start < HEADER.size:
            self._fill(HEADER.size)
        header = _checked_header(*HEADER.unpack_from(self._view, self._start))
        start = self._start = self._start + HEADER.size
        if header.tensor_count:
            descriptors = decode_descriptors(self.read_bytes(header.descriptors_len), header.tensor_count)
            start = self._start
        else:
            descriptors = []
        size = header.payload_len
        if self._end - start >= size:  # buffered: the common case
            self._start = start + size
            return header, descriptors, bytes(self._view[start : start + size])
        return header, descriptors, self.read_bytes(size)

    def read_bytes(self, size: int) -> bytes:
        """The next ``size`` bytes, allocated as they arrive."""
        if size <= len(self._buffer):
            self._fill(size)
            out = bytes(self._view[self._start : self._start + size])
            self._start += size
            return out
        # Memory is taken as bytes arrive (at most twice what arrived, plus 1 MiB): a header
        # announcing more than its sender sends costs the receiver nothing.
        chunks = []
        received = 0
        while received < size:
            chunk = bytearray(min(size - received, max(received, _GROW_CHUNK)))
            self.read_into(memoryview(chunk))
            chunks.append(chunk)
            received += len(chunk)
        return b"".join(chunks)

    def read_into(self, view: memoryview) -> None:
        """Fill ``view``: the buffered bytes first, then straight from the socket."""
        if not view:
            return
        count = min(len(view), self._end - self._start)
        view[:count] = self._view[self._start : self._start + count]
        self._start += count
        size = len(view)
        while count < size:
            got = self._sock.recv_into(view[count:], size - count)
            if got == 0:
                raise EOFError(f"connection closed after {count} of {size} bytes")
            count += got
            self.received += got

    def _fill(self, need: int) -> None:
        if self._end - self._start >= need:
            return
        if self._start + need > len(self._buffer):
            kept = self._end - self._start
            self._view[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        while self._end - self._start < need:
            count = self._sock.recv_into(self._view[self._end :])
            if count == 0:
                raise EOFError(f"connection closed after {self._end - self._start} of {need} bytes")
            self._end += count
            self.received += count


def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Send all of ``data`` (bytes, or a view of a tensor's memory) in chunks of at most 8 MiB."""
    view = memoryview(data)
    for start in range(0, len(view), _SEND_CHUNK):
        sock.sendall(view[start : start + _SEND_CHUNK])
