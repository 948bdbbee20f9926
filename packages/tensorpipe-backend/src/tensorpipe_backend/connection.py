"""One authenticated connection to a peer, and the framing of messages on it.

:meth:`Connection.write` turns a message into a frame (see
:mod:`tensorpipe_backend.wire`): small ones in one ``sendall``, tensors from
their own memory or, to a peer of this host, through shared-memory files;
large ones to a peer of another host half on the connection's lane
(:mod:`tensorpipe_backend.lane`).
:meth:`Connection.receive_tensors` allocates and fills a received frame's
tensors. Who reads the connection, and when, is :mod:`tensorpipe_backend.reader`'s
business; how it is set up is :mod:`tensorpipe_backend.peers`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import select
import socket
import threading
from collections.abc import Callable
from typing import Final

import torch

from rpc_registry import WorkerInfo

from .buffers import RECEIVE_BUFFERS
from .lane import LANE_MIN_BYTES, Lane, lane_head, split_transfer
from .options import DeviceMap
from .outbox import DONTWAIT, Outbox
from .pending import Pending
from .shm import SHM_MIN_BYTES, MissingFileError, SharedFiles
from .transport import DataWait
from .wire import (
    FrameError,
    FrameReader,
    Kind,
    TensorDescriptor,
    device_index,
    encode_descriptors,
    encode_header,
    recv_into,
    send_all,
    small_frame,
    tensor_bytes,
)

__all__ = ["KEEPALIVES", "POSTED_BYTES", "SMALL_PAYLOAD", "Connection", "prepare_tensor"]

SMALL_PAYLOAD: Final = 1 << 16
#: A reply whose payload and tensors sent inline (not through shared memory) total at most this
#: many bytes can be posted whole to the outbox (see :meth:`Connection.frame_to_post`), unless
#: one of those tensors is of :data:`.lane.LANE_MIN_BYTES` or more (a second connection would
#: speed it up).
POSTED_BYTES: Final = 16 << 20
"""Payloads up to this size go out in one ``sendall`` with their header."""
# A lane is attached on this end once the dialler's confirmation is read: a frame that uses it
# may come first.
_LANE_ATTACH_WAIT: Final = 10.0
# A keepalive is a PONG nobody asked for (id 0: no ping has it), as WebSocket's unsolicited pong:
# every version of the agent ignores it.
_KEEPALIVE: Final = small_frame(Kind.PONG, 0, b"")
KEEPALIVES: Final = bool(DONTWAIT)
"""Whether :meth:`Connection.send_keepalive` can send without blocking on this platform."""


def _cuda_mapping_error(device: torch.device, dest: str, is_request: bool) -> RuntimeError:
    side = "Request" if is_request else "Response"
    return RuntimeError(
        "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to CPU "
        "before sending them over RPC, or call `set_device_map` on `TensorPipeRpcBackendOptions` to "
        f"explicitly configure device mapping. {side} device mapping is not available for destination "
        f"{dest} (tensor on {device})"
    )


def prepare_tensor(
    tensor: torch.Tensor, device_map: DeviceMap, dest: str, is_request: bool = True
) -> tuple[TensorDescriptor, torch.Tensor]:
    """Where ``tensor`` lands at ``dest``, and its contiguous CPU data to send.

    CPU tensors stay on the CPU; a CUDA tensor goes to ``device_map[its
    device]`` and is staged through host memory. A CUDA tensor with no entry
    in the map raises torch's error about ``set_device_map``.
    """
    if tensor.layout != torch.strided:
        raise TypeError(f"a tensor with layout {tensor.layout} cannot be sent over RPC; use .to_dense()")
    if tensor.device.type == "cpu":
        target = torch.device("cpu")
    else:
        mapped = device_map.get(tensor.device)
        if mapped is None:
            raise _cuda_mapping_error(tensor.device, dest, is_request)
        target = mapped
    data = tensor.detach().resolve_conj().resolve_neg()
    if data.device.type != "cpu":
        data = data.to("cpu")
    data = data.contiguous()
    grad = tensor.requires_grad and (tensor.dtype.is_floating_point or tensor.dtype.is_complex)
    nbytes = data.numel() * data.element_size()
    return TensorDescriptor(data.dtype, target, tuple(data.shape), nbytes, grad), data


class Connection:
    """One authenticated socket to a peer; ``send_lock`` keeps frames whole.

    ``shm`` is set when the peer is on this host and shares its ``/dev/shm``:
    large tensors then travel as shared-memory files, both ways. ``pending``
    holds the calls sent on it that wait for a reply.

    One thread at a time reads it: the one that owns ``stream`` (``owner``).
    The reader thread, whose token is ``reader``, waits for data without
    owning the stream, so that a thread waiting for its own reply can take
    it and read that reply (``TensorPipeAgent.send_wait``). A reader also
    processes each frame it reads (runs the request, completes the reply's
    future); ``busy`` numbers the frame it is processing (``0`` while it
    reads). A reader that the watch finds busy on one frame for too long
    (:mod:`tensorpipe_backend.watch`), or one that sends a call of its own
    (and will likely wait for its reply), hands the socket and the stream to
    a new reader thread and ends when its frame is done.
    Ownership is a dict entry set with ``setdefault``: one C call, so that
    whoever owns the stream can always be told, even after an interrupted
    thread. Readers send replies through ``outbox``, which never waits
    (:mod:`tensorpipe_backend.outbox`); ``spawn(target, name)`` starts its
    writer thread (default: a daemon thread).
    """

    def __init__(
        self,
        peer: WorkerInfo,
        sock: socket.socket,
        shm: SharedFiles | None = None,
        spawn: Callable[[Callable[[], None], str], None] | None = None,
    ) -> None:
        self.peer = peer
        self.sock = sock
        self.stream: FrameReader = FrameReader(sock)
        self.send_lock: threading.Lock = threading.Lock()
        self.outbox: Outbox = Outbox(sock, self.send_lock, peer.name, spawn or _start_thread)
        self.pending: dict[int, Pending] = {}
        self.closed = False
        self.shm = shm
        self.role_lock: threading.Lock = threading.Lock()
        self.owner: dict[str, object] = {}  # reader.OWNER: the reader token or session that owns the stream
        self.poller: select.poll = select.poll()  # used by the stream's owner
        self.poller.register(sock, select.POLLIN)
        self.data_wait: DataWait | None = DataWait(sock) if DataWait.supported else None
        self.reader: object = object()
        self.busy = 0
        self.lane: Lane = Lane()

    # Sending.
    def write(
        self,
        kind: Kind,
        msg_id: int,
        payload: bytes,
        prepared: list[tuple[TensorDescriptor, torch.Tensor]],
        shm_tokens: list[bytes] | None = None,
    ) -> None:
        """Send one frame; ``shm_tokens`` collects the shared-memory files made for it that the
        reply releases. ``ConnectionError`` once closed; :class:`FrameError` for a message over
        a limit of the format, before any byte of it is sent (the connection stays usable)."""
        outbox = self.outbox
        if not prepared and len(payload) <= SMALL_PAYLOAD:
            frame = small_frame(kind, msg_id, payload)
            with self.send_lock:
                if self.closed:
                    raise ConnectionError(f"the connection to {self.peer.name} is closed")
                outbox.send(frame)
            if outbox:
                outbox.flush()  # posted by readers while the lock was held
            return
        shm = self.shm
        if shm is not None and any(desc.nbytes >= SHM_MIN_BYTES for desc, _ in prepared):
            # Checked before any shared-memory file is made: a message over a limit leaves nothing behind.
            block = encode_descriptors([desc for desc, _ in prepared])
            encode_header(kind, msg_id, len(payload), len(prepared), len(block))
            prepared = [
                (_to_shared_memory(shm, desc, data, shm_tokens), data)
                if desc.nbytes >= SHM_MIN_BYTES
                else (desc, data)
                for desc, data in prepared
            ]
        while True:
            with self.send_lock:
                if self.closed:
                    raise ConnectionError(f"the connection to {self.peer.name} is closed")
                if outbox.cleared():  # what readers posted goes first: its first frame may be half out
                    self._write_frame(kind, msg_id, payload, prepared)
                    break
            outbox.wait_for_writer()
        if outbox:
            outbox.flush()

    def _write_frame(
        self, kind: Kind, msg_id: int, payload: bytes, prepared: list[tuple[TensorDescriptor, torch.Tensor]]
    ) -> None:
        """Send a frame with tensors or a large payload (hold ``send_lock``, with the outbox sent)."""
        lane = self.lane.usable()  # under send_lock: the frame and its lane bytes go out in one order
        if lane is not None:
            prepared = [
                (dataclasses.replace(desc, lane=True), data)
                if not desc.shm_token and desc.nbytes >= LANE_MIN_BYTES
                else (desc, data)
                for desc, data in prepared
            ]
        descriptors = encode_descriptors([desc for desc, _ in prepared]) if prepared else b""
        header = encode_header(kind, msg_id, len(payload), len(prepared), len(descriptors))
        try:
            self._send_frame(header, descriptors, payload, prepared, lane)
        except BaseException:
            # Part of a frame may be out: the stream is broken for the peer too. Shut down
            # (not closed: a reader may be blocked on it), so both readers end the connection.
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.lane.close()
            raise

    def frame_to_post(
        self, kind: Kind, msg_id: int, payload: bytes, prepared: list[tuple[TensorDescriptor, torch.Tensor]]
    ) -> bytes | None:
        """The whole frame, to post to the outbox, where what it carries inline (the payload and
        the tensors that do not go through shared memory) is at most :data:`POSTED_BYTES`; None
        otherwise (send it with :meth:`write`). :class:`FrameError` as :meth:`write`."""
        shm = self.shm
        inline_sizes = [desc.nbytes for desc, _ in prepared if shm is None or desc.nbytes < SHM_MIN_BYTES]
        if len(payload) + sum(inline_sizes) > POSTED_BYTES or any(n >= LANE_MIN_BYTES for n in inline_sizes):
            return None
        if shm is not None and any(desc.nbytes >= SHM_MIN_BYTES for desc, _ in prepared):
            # Checked before any shared-memory file is made, as in write.
            encode_header(
                kind, msg_id, len(payload), len(prepared), len(encode_descriptors([d for d, _ in prepared]))
            )
            prepared = [
                (_to_shared_memory(shm, desc, data, None), data)
                if desc.nbytes >= SHM_MIN_BYTES
                else (desc, data)
                for desc, data in prepared
            ]
        descriptors = encode_descriptors([desc for desc, _ in prepared]) if prepared else b""
        header = encode_header(kind, msg_id, len(payload), len(prepared), len(descriptors))
        inline_tensors = [tensor_bytes(data) for desc, data in prepared if not desc.shm_token]
        return b"".join([header, descriptors, payload, *inline_tensors])

    def post(self, kind: Kind, msg_id: int, payload: bytes) -> None:
        """Send a frame with a small payload (no tensors) without waiting, through the outbox: how a
        reader answers (see :mod:`tensorpipe_backend.outbox`)."""
        if not self.closed:
            self.outbox.post(small_frame(kind, msg_id, payload))

    def _send_frame(
        self,
        header: bytes,
        descriptors: bytes,
        payload: bytes,
        prepared: list[tuple[TensorDescriptor, torch.Tensor]],
        lane: socket.socket | None,
    ) -> None:
        """Send a frame and its tensors (hold ``send_lock``)."""
        if len(payload) <= SMALL_PAYLOAD:
            self.sock.sendall(b"".join((header, descriptors, payload)))
        else:
            self.sock.sendall(header + descriptors)
            send_all(self.sock, payload)
        for desc, data in prepared:
            if desc.shm_token:
                continue
            view = tensor_bytes(data)
            if desc.lane and lane is not None:
                head = lane_head(len(view))
                split_transfer(
                    functools.partial(send_all, self.sock, view[:head]),
                    functools.partial(send_all, lane, view[head:]),
                    lane,
                )
            else:
                send_all(self.sock, view)

    def send_keepalive(self) -> None:
        """Send a keepalive frame, unless another frame is being sent or waits in the outbox (whose
        bytes show this worker alive as well) or the socket's buffer is full (the peer does not
        read). Never blocks."""
        if not self.send_lock.acquire(blocking=False):
            return
        try:
            if self.closed or self.outbox:
                return
            try:
                sent = self.sock.send(_KEEPALIVE, DONTWAIT)
            except OSError:  # full (BlockingIOError), or broken: the reader sees the latter
                return
            if sent != len(_KEEPALIVE):
                # Part of a frame is out and the rest cannot follow without blocking: the stream is
                # broken for the peer too (see write()).
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
        finally:
            self.send_lock.release()
        if self.outbox:
            self.outbox.flush()

    # Receiving.
    def receive_tensors(
        self, descs: list[TensorDescriptor], cuda_count: int, me: str
    ) -> tuple[tuple[torch.Tensor, ...], str | None]:
        """The tensors of the frame just read (``me`` has ``cuda_count`` devices), and why the
        message cannot be delivered (``None``: it can)."""
        tensors: list[torch.Tensor] = []
        error: str | None = None
        for desc in descs:
            if desc.shm_token:
                if self.shm is None:
                    raise FrameError("a shared-memory tensor from a peer that is not on this host")
                try:
                    tensor = self.shm.receive(
                        desc.shm_token, desc.shm_pooled, desc.dtype, desc.shape, desc.nbytes
                    )
                except MissingFileError as exc:
                    # A request file its caller unlinked when the call timed out: not the peer's fault.
                    error = error or f"{exc}; the call may have timed out"
                    tensor = torch.empty(0)
            else:
                lane = self._lane() if desc.lane else None
                try:
                    tensor = RECEIVE_BUFFERS.empty(desc.shape, desc.dtype)
                except (RuntimeError, OSError, ValueError, OverflowError) as exc:
                    raise FrameError(f"cannot allocate a tensor of shape {desc.shape}: {exc}") from exc
                view = tensor_bytes(tensor)
                if lane is not None:
                    head = lane_head(len(view))
                    split_transfer(
                        functools.partial(self.stream.read_into, view[:head]),
                        functools.partial(recv_into, lane, view[head:]),
                        lane,
                    )
                else:
                    self.stream.read_into(view)
            if desc.device.type == "cuda" and error is None:
                if device_index(desc.device) >= cuda_count:
                    error = (
                        f"{me} has {cuda_count} CUDA devices and cannot place a tensor on "
                        f"{desc.device}; fix the sender's device map"
                    )
                else:
                    tensor = tensor.to(desc.device)
            if desc.requires_grad:
                tensor.requires_grad_()
            tensors.append(tensor)
        return tuple(tensors), error

    def _lane(self) -> socket.socket:
        """The lane that brings the rest of a split tensor (it may still be on its
        way: the peer sends on it once it read the confirmation, maybe before this end attached)."""
        if not self.lane.claimed:
            raise FrameError(f"a tensor split over a lane, and no lane with {self.peer.name}")
        lane = self.lane.wait(_LANE_ATTACH_WAIT)
        if lane is None:
            if self.lane.closed:
                raise EOFError(f"the lane to {self.peer.name} closed")
            raise FrameError(
                f"a tensor split over a lane, and no lane with {self.peer.name} within {_LANE_ATTACH_WAIT:g} s"
            )
        return lane


def _start_thread(target: Callable[[], None], name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()


def _to_shared_memory(
    shm: SharedFiles, desc: TensorDescriptor, data: torch.Tensor, created: list[bytes] | None
) -> TensorDescriptor:
    """``desc`` naming a shared-memory file now holding ``data``; ``created`` collects unpooled ones."""
    token, pooled = shm.write(tensor_bytes(data))
    if created is not None and not pooled:
        created.append(token)
    return dataclasses.replace(desc, shm_token=token, shm_pooled=pooled)
