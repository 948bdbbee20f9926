"""``TensorPipeAgent``: moves ``rpc_registry`` messages between workers over sockets.

One authenticated connection per pair of workers carries requests and
replies both ways: a Unix socket between workers of one host (found through
their published host identity), TCP otherwise. When two workers dial each
other at once, the dial of the lower rank wins and the other is told to use
it. One thread at a time reads a connection, through a buffer, and runs what
it reads itself: the called function, the completion of a reply's future.
A reader that calls out, or is still busy after a watch tick (5 ms), hands
the socket to a new reader thread, so a slow or nested call never stalls the
connection; requests of one peer reach the handler in the order the peer
sent them. A thread waiting in ``send_wait`` (``rpc_sync``) reads its reply
itself when the reader thread is idle (Linux). Liveness comes from TCP keepalive and ``TCP_USER_TIMEOUT`` (about
four seconds); a killed process is noticed at once because its kernel
closes its sockets.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import heapq
import ipaddress
import itertools
import logging
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import torch
from torch.distributed.distributed_c10d import Store
from torch.futures import Future

from rpc_registry import Message, RequestHandler, WorkerInfo

from .address import ADDR_ENV, check_reachable, listen_host
from .auth import (
    AuthenticationError,
    HandshakeStatus,
    PeerIdentity,
    client_handshake,
    server_handshake,
)
from .device_maps import create_device_list, create_reverse_mapping, validate_device_maps
from .group import (
    WorkerRecord,
    gather_signed_records,
    members,
    membership_token,
    publish_signed_record,
    record_key,
    set_members,
)
from .options import DeviceMap, TensorPipeRpcBackendOptions
from .rounds import GroupRounds
from .secret import resolve_secret
from .shm import SHM_MIN_BYTES, MissingFileError, SharedFiles, host_identity
from .wire import (
    FrameError,
    FrameReader,
    Kind,
    TensorDescriptor,
    device_index,
    encode_descriptors,
    encode_header,
    send_all,
    small_frame,
    tensor_bytes,
)

logger = logging.getLogger(__name__)

__all__ = ["ADDR_ENV", "TensorPipeAgent", "get_current_agent", "prepare_tensor"]

_HANDSHAKE_TIMEOUT: Final = 30.0
_MAX_HANDSHAKES: Final = 64
_SMALL_PAYLOAD: Final = 1 << 16
_STRAND_BATCH: Final = 32
_WATCH_TICK: Final = 0.005
_WATCH_IDLE_TICKS: Final = 200
_BATCH_FRAMES: Final = 256
_WAIT_TICK: Final = 1.0  # a reader waiting for data checks this often whether its connection closed
_CREDENTIALS: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
_KEEPALIVE: Final = {"TCP_KEEPIDLE": 1, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 4000}

_current: weakref.ref[TensorPipeAgent] | None = None
_local = threading.local()  # .reading: (connection, reader token) while a reader thread processes a frame


def get_current_agent() -> TensorPipeAgent:
    """The agent most recently created in this process, if it is still running."""
    agent = _current() if _current is not None else None
    if agent is None or agent.is_shut_down:
        raise RuntimeError(
            "no TensorPipeAgent is running in this process: call rpc_registry.init_rpc() first"
        )
    return agent


def _fail(fut: Future[Any], exc: BaseException) -> None:
    fut.set_exception(exc)


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


def _local_listener() -> socket.socket | None:
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


def _tune(sock: socket.socket) -> None:
    if sock.family == socket.AF_UNIX:
        return  # no TCP options; a peer's death closes the socket at once
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in _KEEPALIVE.items():
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


ReplySink = Future[Message] | Callable[[Message | BaseException], None]


class _Pending:
    __slots__ = ("msg_id", "peer", "shm_tokens", "sink")

    def __init__(self, sink: ReplySink, msg_id: int, peer: str) -> None:
        self.sink = sink
        self.msg_id = msg_id
        self.peer = peer
        self.shm_tokens: list[bytes] = []

    def deliver(self, outcome: Message | BaseException) -> None:
        """Complete the future, or call the callback, with the reply or the error."""
        sink = self.sink
        if not isinstance(sink, Future):
            sink(outcome)
        elif isinstance(outcome, BaseException):
            _fail(sink, outcome)
        else:
            sink.set_result(outcome)

    @property
    def what(self) -> str:
        return f"rpc {self.msg_id} to {self.peer}"


class _Reply:
    """The reply one thread waits for (see :meth:`TensorPipeAgent.send_wait`); set once."""

    __slots__ = ("_ready", "outcome")

    def __init__(self) -> None:
        self.outcome: Message | BaseException | None = None
        self._ready = threading.Lock()
        self._ready.acquire()

    def set(self, outcome: Message | BaseException) -> None:
        self.outcome = outcome
        self._ready.release()

    def wait(self) -> Message:
        """The reply, once set; its error is raised."""
        self._ready.acquire()
        outcome = self.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome


_OWNER: Final = "owner"


class _Session:
    """A thread reading its own reply (see ``TensorPipeAgent._read_for``)."""

    __slots__ = ("thread",)

    def __init__(self) -> None:
        self.thread = threading.get_ident()


class _DataWait:
    """Where a connection's reader thread waits for data: an epoll set of the socket and a nudge.

    A thread that reads its own reply (:meth:`TensorPipeAgent.send_wait`)
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
        with contextlib.suppress(OSError, ValueError):
            self._epoll.modify(self._fd, 0)

    def resume(self, nudge: bool) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._epoll.modify(self._fd, select.EPOLLIN)
            if nudge:
                os.eventfd_write(self._nudge, 1)


def _remote_failure(conn: _Connection, entry: _Pending, payload: bytes) -> RuntimeError:
    """The error an ERROR frame answering ``entry`` stands for."""
    text = payload.decode(errors="replace")
    return RuntimeError(f"worker {conn.peer.name} could not handle {entry.what}: {text}")


class _Connection:
    """One authenticated socket to a peer; ``send_lock`` keeps frames whole.

    ``shm`` is set when the peer is on this host and shares its ``/dev/shm``:
    large tensors then travel as shared-memory files, both ways.

    One thread at a time reads it: the one that owns ``stream`` (``owner``).
    The reader thread, whose token is ``reader``, waits for data without
    owning the stream, so that a thread waiting for its own reply can take
    it and read that reply (``send_wait``). A reader also processes each
    frame it reads (runs the request, completes the reply's future);
    ``busy`` numbers the frame it is processing (``0`` while it reads). A
    reader busy for a whole watch tick, or one that sends a call of its own
    (and will likely wait for its reply), hands the socket and the stream
    to a new reader thread and ends when its frame is done. Ownership is a
    dict entry set with ``setdefault``: one C call, so that whoever owns the
    stream can always be told, even after an interrupted thread.
    """

    def __init__(self, peer: WorkerInfo, sock: socket.socket, shm: SharedFiles | None = None) -> None:
        self.peer = peer
        self.sock = sock
        self.stream = FrameReader(sock)
        self.send_lock = threading.Lock()
        self.batch: list[bytes] = []  # small replies the reader writes in one go (under send_lock)
        self.pending: dict[int, _Pending] = {}
        self.closed = False
        self.shm = shm
        self.role_lock = threading.Lock()
        self.owner: dict[str, object] = {}  # _OWNER: the reader token or _Session that owns the stream
        self.poller = select.poll()  # used by the stream's owner
        self.poller.register(sock, select.POLLIN)
        self.data_wait = _DataWait(sock) if _DataWait.supported else None
        self.reader = object()
        self.busy = 0
        self.seen = 0


class _Strand:
    """The queued requests of one peer; drained by one worker thread at a time."""

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[_Connection, int, Message]] = collections.deque()
        self.running = False


class TensorPipeAgent:
    """An ``rpc_registry.RpcAgent`` over authenticated sockets; see the module docstring.

    Created by the backend's init handler (through ``rpc_registry.init_rpc``),
    which passes the rendezvous ``store``. ``world_size=None`` joins a dynamic
    group. The constructor returns once this worker is reachable and, in a
    static group, every worker has checked the group's device maps.
    """

    handler_may_block: Final = True
    """The request handler may run the called function before it returns (see
    ``rpc_registry.protocols.RpcAgent``): a reader thread that processes a frame
    for a whole watch tick, or calls out, hands its socket to a new reader."""

    def __init__(
        self,
        store: Store,
        name: str,
        rank: int,
        world_size: int | None,
        options: TensorPipeRpcBackendOptions,
    ) -> None:
        global _current
        self._store = store
        self._options = options
        self._me = WorkerInfo(name, rank)
        self._world_size = world_size
        self._rpc_timeout = options.rpc_timeout
        # One lock guards the agent's state; hot paths take it directly (not through a Condition).
        self._lock = lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._timer = threading.Condition(lock)  # wakes only the deadline thread
        self._idle_waits = 0  # threads waiting for no call in flight (_reply_sent wakes them)
        self._records: dict[str, WorkerRecord] = {}
        self._infos: dict[str, tuple[WorkerRecord, WorkerInfo]] = {}  # get_worker_info's, per record
        self._conns: dict[str, _Connection] = {}
        self._dialing: set[str] = set()
        self._left: dict[str, str] = {}
        self._strands: dict[str, _Strand] = {}
        self._pings: dict[int, threading.Event] = {}
        self._handler: RequestHandler | None = None
        self._in_flight = 0
        self._handshakes = 0
        self._ids = itertools.count(1)
        self._closed = False
        self._said_goodbye = False
        self._threads: list[threading.Thread] = []
        self._device_maps = options.device_maps
        self._reverse_maps: dict[str, DeviceMap] = {}
        self._devices: list[torch.device] = []
        self._cuda_count = torch.cuda.device_count()
        self._pool = ThreadPoolExecutor(options.num_worker_threads, thread_name_prefix=f"tpb-{name}")
        self._deadlines: list[tuple[float, int, _Connection, int, float]] = []
        self._deadline_seq = itertools.count()
        self._listener: socket.socket | None = None
        self._local_listener: socket.socket | None = None
        self._rounds: GroupRounds | None = None
        self._busy_seq = itertools.count(1)
        self._watch_idle = False
        self._watch_wake = threading.Event()
        try:
            self._secret = resolve_secret(
                options.auth_token, store, rank, world_size is not None, self._init_timeout, options.insecure
            )
            host = listen_host(options.init_method)
            self._listener = socket.create_server((host, 0))
            self._listener.settimeout(0.2)
            shm_host = host_identity()
            self._local_listener = _local_listener() if shm_host else None
            record = WorkerRecord(
                name,
                rank,
                host,
                self._listener.getsockname()[1],
                self._cuda_count,
                self._device_maps,
                options.devices,
                shm_host,
                self._local_listener.getsockname()[1:].decode() if self._local_listener else "",
            )
            self._spawn(self._accept_loop, "accept", self._listener)
            if self._local_listener is not None:
                self._spawn(self._accept_loop, "accept-local", self._local_listener)
            self._spawn(self._deadline_loop, "deadlines")
            self._spawn(self._watch_loop, "watch")
            if world_size is not None:
                self._join_static(record, world_size)
            else:
                self._join_dynamic(record)
        except BaseException:
            self._close_now()
            raise
        _current = weakref.ref(self)
        logger.debug("agent %s (rank %d) listens on %s:%d", name, rank, host, record.port)

    # Group set-up.
    @property
    def _init_timeout(self) -> float:
        return self._rpc_timeout if self._rpc_timeout > 0 else 300.0

    def _publish(self, record: WorkerRecord) -> None:
        text = record.to_json()
        current = self._store.compare_set(record_key(record.name), "", text).decode()
        if current != text:
            other = WorkerRecord.from_json(current)
            raise ValueError(
                f"name={record.name!r}: already used by the worker of rank {other.rank}; "
                "give every worker a unique name"
            )
        self._records[record.name] = record

    def _join_static(self, record: WorkerRecord, world_size: int) -> None:
        timeout = self._init_timeout
        self._records[record.name] = record
        publish_signed_record(self._store, record, self._secret)
        parsed = gather_signed_records(self._store, self._secret, world_size, record.rank, timeout)
        names = [r.name for r in parsed]
        records = {r.name: r for r in parsed}
        if len(records) < world_size:
            duplicate = next(n for n in names if names.count(n) > 1)
            ranks = [r for r, n in enumerate(names) if n == duplicate]
            raise ValueError(
                f"name={duplicate!r}: used by the workers of ranks {ranks}; give every worker a unique name"
            )
        check_reachable(parsed)
        validate_device_maps(
            names,
            {n: r.device_count for n, r in records.items()},
            {n: r.device_maps for n, r in records.items()},
            {n: r.devices for n, r in records.items()},
        )
        reverse = create_reverse_mapping(record.name, names, {n: r.device_maps for n, r in records.items()})
        with self._lock:
            self._rounds = rounds = GroupRounds(record.rank, names, self._send_round)
            self._records = records
            self._reverse_maps = reverse
            self._devices = create_device_list(record.devices, self._device_maps, reverse)
            self._cond.notify_all()
        if self._devices and torch.cuda.is_available():
            torch.cuda.init()
        # Every worker connects to rank 0 in this barrier, so connections exist before the first shutdown.
        rounds.barrier(timeout, "the end of init_rpc")

    def _join_dynamic(self, record: WorkerRecord) -> None:
        store, timeout = self._store, self._init_timeout
        with membership_token(store, record.name, timeout):
            current = members(store)
            if record.name in current:
                raise ValueError(f"name={record.name!r}: a worker of this name is already in the group")
            self._publish(record)
            records = {n: WorkerRecord.from_json(store.get(record_key(n))) for n in current}
            records[record.name] = record
            names = [*current, record.name]
            check_reachable(records.values())
            validate_device_maps(
                names,
                {n: r.device_count for n, r in records.items()},
                {n: r.device_maps for n, r in records.items()},
                {n: r.devices for n, r in records.items()},
                is_static_group=False,
            )
            with self._lock:
                for other in records.values():
                    self._learn(other)
            set_members(store, names)
            # Each member loads this worker's record when it accepts the connection,
            # and computes its own reverse map to this worker from it.
            for peer in current:
                try:
                    self._ping(peer, timeout)
                except (OSError, TimeoutError) as exc:
                    logger.warning("%s: member %s did not answer while joining: %s", record.name, peer, exc)

    def _learn(self, record: WorkerRecord) -> None:
        """Remember ``record`` and the reverse map it implies (hold ``_cond``)."""
        self._records[record.name] = record
        self._left.pop(record.name, None)
        map_to_me = record.device_maps.get(self._me.name)
        if map_to_me is not None:
            self._reverse_maps[record.name] = {dst: src for src, dst in map_to_me.items()}
        self._devices = create_device_list(self._options.devices, self._device_maps, self._reverse_maps)

    def _record(self, name: str) -> WorkerRecord | None:
        known = self._records.get(name)
        if known is not None:
            return known
        world_size = self._world_size
        if world_size is not None:
            # A peer may connect before this worker has stored the group's records
            # (the init thread is between the all-gather and here): wait for them.
            with self._lock:
                self._cond.wait_for(
                    lambda: name in self._records or len(self._records) >= world_size or self._closed,
                    timeout=self._init_timeout,
                )
                return self._records.get(name)
        with self._lock:
            record = self._records.get(name)
        if record is not None:
            return record
        key = record_key(name)
        if not self._store.check([key]):
            return None
        record = WorkerRecord.from_json(self._store.get(key))
        with self._lock:
            self._learn(record)
        return record

    # The RpcAgent protocol.
    @property
    def rpc_timeout(self) -> float:
        """The default timeout in seconds that ``timeout=-1`` stands for."""
        return self._rpc_timeout

    @property
    def is_shut_down(self) -> bool:
        """Whether :meth:`shutdown` ran."""
        return self._closed

    @property
    def address(self) -> tuple[str, int]:
        """The host and port this worker listens on (published to its peers through the store)."""
        record = self._records[self._me.name]
        return record.host, record.port

    @property
    def peer_transports(self) -> dict[str, str]:
        """How this worker reaches each connected peer: ``"unix"`` (a Unix socket, same host) or ``"tcp"``."""
        with self._lock:
            conns = list(self._conns.values())
        return {
            c.peer.name: "unix" if c.sock.family == socket.AF_UNIX else "tcp" for c in conns if not c.closed
        }

    @property
    def reverse_device_maps(self) -> dict[str, DeviceMap]:
        """Per peer that maps devices to this worker: {this worker's device: the peer's}, for replies."""
        with self._lock:
            return {name: dict(map_) for name, map_ in self._reverse_maps.items()}

    @property
    def devices(self) -> list[torch.device]:
        """The local CUDA devices this agent handles."""
        with self._lock:
            return list(self._devices)

    def start(self, handler: RequestHandler) -> None:
        """Begin delivering incoming requests (queued ones first) to ``handler``."""
        with self._lock:
            self._handler = handler
            ready = [s for s in self._strands.values() if s.queue and not s.running]
            for strand in ready:
                strand.running = True
        for strand in ready:
            self._pool.submit(self._drain, strand)

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """The named worker's info, or this worker's; ``ValueError`` naming an unknown or departed one."""
        if worker_name is None or worker_name == self._me.name:
            return self._me
        record = self._records.get(worker_name) or self._record(worker_name)
        if record is None:
            with self._lock:
                reason = self._left.get(worker_name)
                known = sorted(self._records)
            if reason is not None:
                raise ValueError(f"worker_name={worker_name!r}: worker {worker_name} {reason}")
            raise ValueError(
                f"worker_name={worker_name!r}: no worker of this name in the group (known: {known})"
            )
        cached = self._infos.get(worker_name)
        if cached is not None and cached[0] is record:
            return cached[1]
        info = WorkerInfo(record.name, record.rank)
        self._infos[worker_name] = (record, info)
        return info

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker known to be in the group, this one included, by rank."""
        if self._world_size is None and not self._closed:
            for name in members(self._store):
                self._record(name)
        with self._lock:
            infos = {WorkerInfo(r.name, r.rank) for n, r in self._records.items() if n not in self._left}
        return sorted(infos | {self._me}, key=lambda info: info.id)

    def send(self, to: WorkerInfo, message: Message, timeout: float) -> Future[Message]:
        """Send a request to ``to``; the future holds the reply or an error naming ``to``."""
        future: Future[Message] = Future()
        self._send(to, message, timeout, future)
        return future

    def send_then(
        self,
        to: WorkerInfo,
        message: Message,
        timeout: float,
        callback: Callable[[Message | BaseException], None],
    ) -> None:
        """Like :meth:`send`, but call ``callback`` with the reply or the error instead of completing a
        future (it runs on the thread that reads the reply; it must not raise)."""
        self._send(to, message, timeout, callback)

    def send_wait(self, to: WorkerInfo, message: Message, timeout: float) -> Message:
        """Send a request to ``to`` and return its reply, raising the error that :meth:`send`'s
        future would hold.

        When the connection's reader thread is waiting for data, this thread
        reads the reply itself (one thread wake-up less per call); otherwise
        the reader thread hands it over.
        """
        reply = _Reply()
        sent = self._send(to, message, timeout, reply.set)
        if sent is None:
            return reply.wait()
        conn, msg_id = sent
        try:
            if reply.outcome is None and conn.data_wait is not None:
                self._read_for(conn, msg_id, reply, time.monotonic() + timeout if timeout > 0 else None)
            return reply.wait()
        except BaseException:
            # Interrupted (a signal handler raised): nobody waits for the reply any more.
            self._forget(conn, msg_id)
            raise

    def _send(
        self, to: WorkerInfo, message: Message, timeout: float, sink: ReplySink
    ) -> tuple[_Connection, int] | None:
        """Send a request; the connection it went out on and its id (``None``: ``sink`` already has
        the error)."""
        if self._closed:
            raise RuntimeError(f"{self._me.name}: the agent is shut down; call init_rpc() again to send")
        reading = getattr(_local, "reading", None)
        if reading is not None:
            # A reader thread calling out will likely wait for the reply: another thread reads meanwhile.
            _local.reading = None
            self._hand_off(*reading)
        pending = _Pending(sink, next(self._ids), to.name)
        reason = self._left.get(to.name)
        if reason is not None:
            pending.deliver(ConnectionError(f"worker {to.name} {reason}; the call was not sent"))
            return None
        prepared = []
        if message.tensors:
            device_map = self._device_maps.get(to.name, {})
            prepared = [prepare_tensor(t, device_map, to.name, is_request=True) for t in message.tensors]
        deadline = time.monotonic() + timeout if timeout > 0 else None
        conn = self._conns.get(to.name)
        if conn is None or conn.closed:
            conn = self._connection(to.name, deadline)
        msg_id = pending.msg_id
        try:  # a signal handler raising in here (main thread) must not leave the call registered
            with self._lock:
                if conn.closed:
                    closed = True
                else:
                    closed = False
                    conn.pending[msg_id] = pending
                    self._in_flight += 1
                    if deadline is not None:
                        # Wake the deadline thread only when this deadline comes before all the others.
                        earliest = not self._deadlines or deadline < self._deadlines[0][0]
                        heapq.heappush(
                            self._deadlines, (deadline, next(self._deadline_seq), conn, msg_id, timeout)
                        )
                        if earliest:
                            self._timer.notify()
                        if len(self._deadlines) > 1024 and len(self._deadlines) > 4 * self._in_flight:
                            # Answered calls leave their deadline behind: drop those, keep the heap small.
                            self._deadlines = [d for d in self._deadlines if d[3] in d[2].pending]
                            heapq.heapify(self._deadlines)
            if closed:
                pending.deliver(ConnectionError(f"worker {to.name}: the connection closed before sending"))
                return None
            try:
                self._write(conn, Kind.REQUEST, msg_id, message.payload, prepared, pending.shm_tokens)
            except (OSError, FrameError) as exc:
                self._drop(conn, f"sending to it failed ({exc})")
                return None
        except BaseException:
            self._forget(conn, msg_id)
            raise
        return conn, msg_id

    def sync(self) -> None:
        """A barrier of the static group (at most ``rpc_timeout`` s); a dynamic group has none."""
        if self._world_size is not None:
            self._static_group().barrier(self._rpc_timeout, "sync()")

    def join(self, shutdown: bool = False, timeout: float = 0) -> None:
        """Wait until no worker has a call in flight (``timeout`` s, ``0``: no limit).

        A static group repeats a round (see :mod:`tensorpipe_backend.rounds`)
        that sums every worker's calls in flight until one sums to zero. A worker
        of a dynamic group waits for its own calls, then (with
        ``shutdown=True``) leaves the group, telling its peers.
        """
        deadline = time.monotonic() + timeout if timeout > 0 else None
        if self._world_size is None:
            self._wait_idle(deadline)
            if shutdown:
                self._leave(deadline)
            return
        group, what = self._static_group(), "a shutdown barrier with no call in flight"
        while True:
            remaining = 0.0 if deadline is None else max(deadline - time.monotonic(), 0.001)
            if group.sum(self._active(), remaining, what) == 0:
                break
            with self._lock:
                self._idle_waits += 1
                try:
                    self._cond.wait_for(lambda: self._in_flight == 0, timeout=0.05)
                finally:
                    self._idle_waits -= 1
        if shutdown:
            self._goodbye("has shut down")

    def shutdown(self) -> None:
        """Close every connection and stop the threads; pending calls fail naming their peer."""
        self._goodbye("has shut down")
        self._close_now()

    # Shutdown helpers.
    def _static_group(self) -> GroupRounds:
        group = self._rounds
        if group is None:
            raise RuntimeError(f"{self._me.name}: the agent is shut down")
        return group

    def _active(self) -> int:
        with self._lock:
            return self._in_flight

    def _wait_idle(self, deadline: float | None) -> None:
        with self._lock:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            self._idle_waits += 1
            try:
                idle = self._cond.wait_for(lambda: self._in_flight == 0, timeout=remaining)
            finally:
                self._idle_waits -= 1
            if not idle:
                raise TimeoutError(
                    f"{self._me.name}: {self._in_flight} calls still in flight when the shutdown timeout "
                    "passed; pass a larger timeout or 0 to wait without limit"
                )

    def _leave(self, deadline: float | None) -> None:
        timeout = 0.0 if deadline is None else max(deadline - time.monotonic(), 0.001)
        with membership_token(self._store, self._me.name, timeout):
            set_members(self._store, [n for n in members(self._store) if n != self._me.name])
            self._store.delete_key(record_key(self._me.name))
        self._goodbye("left the group")

    def _goodbye(self, reason: str) -> None:
        with self._lock:
            if self._said_goodbye or self._closed:
                return
            self._said_goodbye = True
            conns = list(self._conns.values())
        for conn in conns:
            try:
                self._write(conn, Kind.GOODBYE, 0, reason.encode(), [])
            except (OSError, FrameError):
                logger.debug("could not say goodbye to %s", conn.peer.name)

    def _close_now(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.values())
            self._cond.notify_all()
            self._timer.notify_all()
        self._watch_wake.set()
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                listener.close()
        for conn in conns:
            self._drop(conn, f"this worker ({self._me.name}) shut down")
        if self._rounds is not None:
            self._rounds.close(f"this worker ({self._me.name}) shut down")
        self._pool.shutdown(wait=False, cancel_futures=True)
        current = threading.current_thread()
        for thread in list(self._threads):
            if thread is not current:
                thread.join(timeout=5)
                if thread.is_alive():
                    logger.warning("thread %s did not stop within 5 s after shutdown", thread.name)

    # Connections.
    def _spawn(self, target: Callable[..., None], what: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"tpb-{self._me.name}-{what}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _connection(self, name: str, deadline: float | None) -> _Connection:
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        raise RuntimeError(f"{self._me.name}: the agent is shut down")
                    conn = self._conns.get(name)
                    if conn is not None and not conn.closed:
                        return conn
                    if name not in self._dialing:
                        break
                    self._wait(deadline, f"a connection to worker {name}")
                self._dialing.add(name)
            try:
                conn = self._dial(name, deadline)
            finally:
                with self._lock:
                    self._dialing.discard(name)
                    self._cond.notify_all()
            if conn is not None:
                return conn
            # The peer keeps another connection with us (its own dial, or one it has not seen close).
            with self._lock:
                self._cond.wait_for(lambda: name in self._conns, timeout=0.05)

    def _wait(self, deadline: float | None, what: str) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(f"{self._me.name}: timed out waiting for {what}")
        self._cond.wait(timeout=remaining if remaining is not None else 1.0)

    def _dial(self, name: str, deadline: float | None) -> _Connection | None:
        record = self._record(name)
        if record is None:
            raise ValueError(f"worker {name!r} is not in the group; it may have left")
        limit = _HANDSHAKE_TIMEOUT if deadline is None else max(min(deadline - time.monotonic(), 30.0), 0.01)
        try:
            sock = self._dial_local(record, limit) or socket.create_connection(
                (record.host, record.port), timeout=limit
            )
        except OSError as exc:
            raise ConnectionError(
                f"worker {name} (rank {record.rank}) at {record.host}:{record.port} is unreachable: {exc}"
            ) from exc
        try:
            _tune(sock)
            peer = PeerIdentity(name, record.rank)
            _, status = client_handshake(sock, self._secret, PeerIdentity(self._me.name, self._me.id), peer)
        except (OSError, EOFError, struct.error) as exc:
            _close(sock)
            if isinstance(exc, AuthenticationError):
                raise
            raise ConnectionError(f"worker {name}: connecting failed during authentication ({exc})") from exc
        if status is HandshakeStatus.DUPLICATE:
            _close(sock)
            return None
        sock.settimeout(None)
        conn = _Connection(WorkerInfo(name, record.rank), sock, self._shared_files(record, sock))
        with self._lock:
            old = self._conns.get(name)
            self._conns[name] = conn
            self._cond.notify_all()
        if old is not None and old is not conn:
            self._drop(old, "replaced by a new connection")
        self._spawn(self._read_loop, f"read-{name}", conn, conn.reader)
        return conn

    def _dial_local(self, record: WorkerRecord, timeout: float) -> socket.socket | None:
        """A Unix socket to a peer on this host, ``None`` when it has none or it cannot be reached."""
        mine = self._records.get(self._me.name)
        if not record.local_socket or mine is None or not mine.shm_host or record.shm_host != mine.shm_host:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(b"\0" + record.local_socket.encode())
        except OSError as exc:  # e.g. another network namespace: TCP it is
            logger.debug("%s: no Unix socket to %s (%s); using TCP", self._me.name, record.name, exc)
            sock.close()
            return None
        return sock

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.is_shut_down:
                    return
                time.sleep(0.05)
                continue
            with self._lock:
                if self._handshakes >= _MAX_HANDSHAKES or self._closed:
                    sock.close()
                    continue
                self._handshakes += 1
            self._spawn(self._serve, "serve", sock)

    def _serve(self, sock: socket.socket) -> None:
        conn: list[_Connection] = []

        def decide(peer: PeerIdentity) -> HandshakeStatus:
            record = self._record(peer.name)
            if record is None or record.rank != peer.rank:
                raise AuthenticationError(f"{peer} is not a member of the group")
            with self._lock:
                if self._closed:
                    raise AuthenticationError("this worker is shutting down")
                existing = self._conns.get(peer.name)
                if existing is not None and not existing.closed:
                    return HandshakeStatus.DUPLICATE
                if peer.name in self._dialing and self._me.id < peer.rank:
                    return HandshakeStatus.DUPLICATE
                new = _Connection(WorkerInfo(peer.name, peer.rank), sock, self._shared_files(record, sock))
                # Nothing may be sent on it before the verdict.
                new.send_lock.acquire()
                self._conns[peer.name] = new
                self._cond.notify_all()
                conn.append(new)
                return HandshakeStatus.ACCEPTED

        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT)
            _tune(sock)
            server_handshake(sock, self._secret, PeerIdentity(self._me.name, self._me.id), decide)
        except (OSError, EOFError, struct.error, ValueError) as exc:
            logger.warning("%s: rejected a connection: %s", self._me.name, exc)
            if conn:
                conn[0].send_lock.release()
                self._drop(conn[0], f"authentication failed ({exc})")
            else:
                _close(sock)
            return
        finally:
            with self._lock:
                self._handshakes -= 1
        if not conn:
            _close(sock)
            return
        sock.settimeout(None)
        conn[0].send_lock.release()
        self._read_loop(conn[0], conn[0].reader)

    def _shared_files(self, record: WorkerRecord, sock: socket.socket) -> SharedFiles | None:
        """Shared-memory files for an authenticated peer on this host; ``None`` for other peers."""
        mine = self._records.get(self._me.name)
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

    def _drop(self, conn: _Connection, reason: str) -> None:
        current = False
        with self._lock:
            conn.closed = True
            if self._conns.get(conn.peer.name) is conn:
                del self._conns[conn.peer.name]
                current = True
            pending, conn.pending = conn.pending, {}
            self._in_flight -= len(pending)
            left = self._left.get(conn.peer.name)
            self._cond.notify_all()
        _close(conn.sock)
        if conn.shm is not None:
            conn.shm.close()
        name = conn.peer.name
        rounds = self._rounds
        if current and rounds is not None:
            rounds.lost(conn.peer.id, f"it {left}" if left else reason)
        for entry in pending.values():
            text = f"worker {name} {left}" if left else f"worker {name} (rank {conn.peer.id}): {reason}"
            entry.deliver(ConnectionError(f"{text}; {entry.what} did not complete"))

    # Frames.
    def _write(
        self,
        conn: _Connection,
        kind: Kind,
        msg_id: int,
        payload: bytes,
        prepared: list[tuple[TensorDescriptor, torch.Tensor]],
        shm_tokens: list[bytes] | None = None,
    ) -> None:
        if not prepared and len(payload) <= _SMALL_PAYLOAD:
            frame = small_frame(kind, msg_id, payload)
            with conn.send_lock:
                if conn.closed:
                    raise ConnectionError(f"the connection to {conn.peer.name} is closed")
                conn.sock.sendall(frame)
            return
        shm = conn.shm
        if shm is not None and prepared:
            prepared = [
                (self._to_shared_memory(shm, desc, data, shm_tokens), data)
                if desc.nbytes >= SHM_MIN_BYTES
                else (desc, data)
                for desc, data in prepared
            ]
        descriptors = encode_descriptors([desc for desc, _ in prepared]) if prepared else b""
        header = encode_header(kind, msg_id, len(payload), len(prepared), len(descriptors))
        with conn.send_lock:
            if conn.closed:
                raise ConnectionError(f"the connection to {conn.peer.name} is closed")
            if len(payload) <= _SMALL_PAYLOAD:
                conn.sock.sendall(b"".join((header, descriptors, payload)))
            else:
                conn.sock.sendall(header + descriptors)
                send_all(conn.sock, payload)
            for desc, data in prepared:
                if not desc.shm_token:
                    send_all(conn.sock, tensor_bytes(data))

    @staticmethod
    def _to_shared_memory(
        shm: SharedFiles, desc: TensorDescriptor, data: torch.Tensor, created: list[bytes] | None
    ) -> TensorDescriptor:
        """``desc`` naming a shared-memory file now holding ``data``; ``created`` collects unpooled ones."""
        token, pooled = shm.write(tensor_bytes(data))
        if created is not None and not pooled:
            created.append(token)
        return dataclasses.replace(desc, shm_token=token, shm_pooled=pooled)

    def _flush(self, conn: _Connection) -> None:
        """Write the replies the reader batched."""
        if not conn.batch:
            return
        with conn.send_lock:
            if not conn.batch:
                return
            data, conn.batch = b"".join(conn.batch), []
            if not conn.closed:
                conn.sock.sendall(data)

    def _read_loop(self, conn: _Connection, token: object, holding: bool = False) -> None:
        """Read and process frames while this thread holds ``conn``'s reader token.

        Where ``send_wait`` can read its reply in the caller's thread, the
        reader waits for data without owning the stream (in ``conn.data_wait``)
        and takes ``conn.owner`` for each run of frames it reads and
        processes; elsewhere it keeps it. A reader handed the socket
        (``holding``) owns the stream from the start.
        """
        reason = "the connection closed"
        stream = conn.stream
        owner = conn.owner
        data_wait = conn.data_wait
        if holding and data_wait is not None:
            data_wait.resume(False)
        wait = not stream.buffered
        try:
            while True:
                if not holding:
                    if wait and data_wait is not None:
                        self._flush(conn)  # about to wait for the peer: what was batched goes out first
                        if not data_wait.wait(_WAIT_TICK):
                            if conn.closed:
                                return
                            self._heal(conn)
                            wait = not stream.buffered
                            continue
                    if owner.setdefault(_OWNER, token) is not token:
                        # A caller reads its own reply and resumes the wait when done, unless a
                        # signal cut it short: then the stream is taken back here.
                        self._heal(conn)
                        wait = True
                        continue
                    holding = True
                    if conn.reader is not token or conn.closed:
                        return
                if not stream.has_frame():
                    self._flush(conn)  # read_frame may wait for the peer
                header, descs, payload = stream.read_frame()
                tensors, error = self._receive_tensors(conn, descs) if descs else ((), None)
                with conn.role_lock:
                    conn.busy = next(self._busy_seq)
                if self._watch_idle:
                    self._watch_idle = False
                    self._watch_wake.set()
                _local.reading = (conn, token)
                try:
                    self._dispatch(conn, header.kind, header.msg_id, payload, tensors, error)
                finally:
                    _local.reading = None
                    tensors = ()  # a pooled shared-memory file is released when its tensor dies
                with conn.role_lock:
                    if conn.reader is not token:
                        holding = False  # another thread reads now; it owns the stream
                        return
                    conn.busy = 0
                if data_wait is not None and not stream.has_frame():
                    owner.pop(_OWNER, None)
                    holding = False
                    wait = not stream.buffered
        except (FrameError, OSError, EOFError) as exc:
            reason = self._read_failure(conn, exc)
        finally:
            if conn.reader is token:
                self._drop(conn, reason)
            if holding and owner.get(_OWNER) is token:
                owner.pop(_OWNER, None)

    def _read_failure(self, conn: _Connection, exc: Exception) -> str:
        """Why reading ``conn`` failed with ``exc``, for its pending calls (a malformed frame is logged)."""
        if isinstance(exc, FrameError):
            reason = f"it sent a malformed frame ({exc})"
            logger.warning("%s: closing the connection to %s: %s", self._me.name, conn.peer.name, reason)
            return reason
        return "the connection closed" if isinstance(exc, EOFError) else f"the connection failed ({exc})"

    def _read_for(self, conn: _Connection, msg_id: int, reply: _Reply, deadline: float | None) -> None:
        """Read the reply to ``msg_id`` in this thread if ``conn``'s stream is free and that reply
        is the next frame; then give the stream back.

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
        if owner.setdefault(_OWNER, session) is not session:
            return  # the reader thread is reading: it hands the reply over
        reason = None
        try:
            data_wait.pause()  # the reader thread sleeps through this reply
            taken: tuple[Kind, bytes] | bool = not stream.buffered  # just sent: wait before looking
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
                kind, payload = taken
                entry = self._claim(conn, msg_id)
                if entry is None:
                    continue  # timed out or failed meanwhile: reply is set
                if kind is Kind.REPLY:
                    reply.set(Message(payload))
                else:
                    reply.set(_remote_failure(conn, entry, payload))
        except (FrameError, OSError, EOFError) as exc:
            reason = self._read_failure(conn, exc)
        finally:
            if reason is not None:
                self._drop(conn, reason)
            self._end_session(conn, session)

    def _claim(self, conn: _Connection, msg_id: int) -> _Pending | None:
        """Take the call ``msg_id`` out of ``conn``'s pending calls and of the count in flight.

        No call sits between the removal and the count, so a signal handler
        that raises (main thread) cannot split them."""
        with self._lock:
            entry = conn.pending.get(msg_id)
            if entry is not None:
                del conn.pending[msg_id]
                self._in_flight -= 1
                if self._in_flight == 0 and self._idle_waits:
                    self._cond.notify_all()
        if entry is not None and conn.shm is not None:
            conn.shm.release(entry.shm_tokens)
        return entry

    def _forget(self, conn: _Connection, msg_id: int) -> None:
        """Stop waiting for the reply to ``msg_id`` (its caller was interrupted); no-op for a call
        already answered or never registered."""
        self._claim(conn, msg_id)

    @staticmethod
    def _end_session(conn: _Connection, session: _Session) -> None:
        """Give the stream ``session`` owns back to the reader thread (safe to repeat)."""
        if conn.owner.get(_OWNER) is session and conn.data_wait is not None:
            # Resumed before it is released, so no other session's pause is undone.
            conn.data_wait.resume(conn.stream.buffered > 0)
            conn.owner.pop(_OWNER, None)

    def _heal(self, conn: _Connection) -> None:
        """Take the stream back from a session whose thread left ``_read_for`` without giving it
        back (a signal handler raised at the wrong moment)."""
        session = conn.owner.get(_OWNER)
        if not isinstance(session, _Session):
            return
        frame = sys._current_frames().get(session.thread)  # the documented way to see another thread
        while frame is not None:
            if frame.f_code is _READ_FOR_CODE and frame.f_locals.get("session") is session:
                return  # still reading (this session, not one of the thread's on another connection)
            frame = frame.f_back
        logger.debug(
            "%s: taking back the stream of %s from an interrupted call", self._me.name, conn.peer.name
        )
        self._end_session(conn, session)

    def _hand_off(self, conn: _Connection, token: object) -> None:
        """Give ``conn`` a new reader thread if ``token``'s holder is processing a frame."""
        with conn.role_lock:
            if conn.reader is not token or not conn.busy or conn.closed:
                return
            conn.reader = token = object()
            conn.owner[_OWNER] = token  # the busy reader owns the stream: it passes to the new one
            conn.busy = conn.seen = 0
        self._spawn(self._read_loop, f"read-{conn.peer.name}", conn, token, True)
        with conn.send_lock:
            kept = bool(conn.batch)
        if kept:
            self._submit(self._flush, conn)

    def _watch_loop(self) -> None:
        """Every tick, move each connection whose reader was busy all tick long to a new reader."""
        quiet = 0
        while not self._closed:
            time.sleep(_WATCH_TICK)
            with self._lock:
                conns = list(self._conns.values())
            stuck = []
            for conn in conns:
                with conn.role_lock:
                    if conn.busy and conn.busy == conn.seen:
                        stuck.append((conn, conn.reader))
                    conn.seen = conn.busy
            for conn, token in stuck:
                self._hand_off(conn, token)
            if any(conn.busy for conn in conns):
                quiet = 0
                continue
            quiet += 1
            if quiet < _WATCH_IDLE_TICKS:
                continue
            # Idle: sleep until a reader starts processing (it sets the event when it sees the flag).
            self._watch_wake.clear()
            self._watch_idle = True
            # _close_now sets _closed before the event: checked after clear(), no wake-up is lost.
            if not self.is_shut_down and not any(conn.busy for conn in conns):
                self._watch_wake.wait()
            self._watch_idle = False
            quiet = 0

    def _receive_tensors(
        self, conn: _Connection, descs: list[TensorDescriptor]
    ) -> tuple[tuple[torch.Tensor, ...], str | None]:
        tensors: list[torch.Tensor] = []
        error: str | None = None
        for desc in descs:
            if desc.shm_token:
                if conn.shm is None:
                    raise FrameError("a shared-memory tensor from a peer that is not on this host")
                try:
                    tensor = conn.shm.receive(
                        desc.shm_token, desc.shm_pooled, desc.dtype, desc.shape, desc.nbytes
                    )
                except MissingFileError as exc:
                    # A request file its caller unlinked when the call timed out: not the peer's fault.
                    error = error or f"{exc}; the call may have timed out"
                    tensor = torch.empty(0)
            else:
                try:
                    tensor = torch.empty(desc.shape, dtype=desc.dtype)
                except RuntimeError as exc:
                    raise FrameError(f"cannot allocate a tensor of shape {desc.shape}: {exc}") from exc
                conn.stream.read_into(tensor_bytes(tensor))
            if desc.device.type == "cuda" and error is None:
                if device_index(desc.device) >= self._cuda_count:
                    error = (
                        f"{self._me.name} has {self._cuda_count} CUDA devices and cannot place a tensor on "
                        f"{desc.device}; fix the sender's device map"
                    )
                else:
                    tensor = tensor.to(desc.device)
            if desc.requires_grad:
                tensor.requires_grad_()
            tensors.append(tensor)
        return tuple(tensors), error

    def _dispatch(
        self,
        conn: _Connection,
        kind: Kind,
        msg_id: int,
        payload: bytes,
        tensors: tuple[torch.Tensor, ...],
        error: str | None,
    ) -> None:
        if kind is Kind.REQUEST:
            if error is not None:
                self._write(conn, Kind.ERROR, msg_id, error.encode(), [])
                return
            self._enqueue(conn, msg_id, Message(payload, tensors))
        elif kind is Kind.REPLY or kind is Kind.ERROR:
            self._take_reply(conn, kind, msg_id, payload, tensors, error)
        elif kind is Kind.PING:
            self._write(conn, Kind.PONG, msg_id, b"", [])
        elif kind is Kind.PONG:
            with self._lock:
                event = self._pings.pop(msg_id, None)
            if event is not None:
                event.set()
        elif kind is Kind.GROUP:
            rounds = self._rounds
            if rounds is None:
                raise FrameError(f"a group round from {conn.peer.name} outside a static group")
            try:
                rounds.deliver(conn.peer.id, msg_id, payload)
            except ValueError as exc:
                raise FrameError(f"{conn.peer.name}: {exc}") from None
        elif kind is Kind.GOODBYE:
            with self._lock:
                self._left[conn.peer.name] = payload.decode(errors="replace")[:200]
                if self._world_size is None:
                    self._records.pop(conn.peer.name, None)
                    self._reverse_maps.pop(conn.peer.name, None)

    def _take_reply(
        self,
        conn: _Connection,
        kind: Kind,
        msg_id: int,
        payload: bytes,
        tensors: tuple[torch.Tensor, ...],
        error: str | None,
    ) -> None:
        """Complete the call ``msg_id`` with a REPLY or ERROR frame."""
        with self._lock:  # against _drop, which fails what is left
            entry = conn.pending.pop(msg_id, None)
        if entry is None:
            logger.debug("%s: late reply %d from %s dropped", self._me.name, msg_id, conn.peer.name)
            return
        if conn.shm is not None:
            conn.shm.release(entry.shm_tokens)
        outcome: Message | BaseException
        if kind is Kind.ERROR:
            outcome = _remote_failure(conn, entry, payload)
        elif error is not None:
            outcome = RuntimeError(f"the reply to {entry.what} cannot be placed here: {error}")
        else:
            outcome = Message(payload, tensors)
        self._complete(entry, outcome)

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: run it here
            fn(*args)

    def _complete(self, entry: _Pending, outcome: Message | BaseException) -> None:
        try:
            entry.deliver(outcome)
        finally:
            self._reply_sent()

    def _send_round(self, name: str, number: int, payload: bytes) -> None:
        conn = self._connection(name, time.monotonic() + self._init_timeout)
        self._write(conn, Kind.GROUP, number, payload, [])

    def _ping(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        conn = self._connection(name, deadline)
        event = threading.Event()
        msg_id = next(self._ids)
        with self._lock:
            self._pings[msg_id] = event
        self._write(conn, Kind.PING, msg_id, b"", [])
        if not event.wait(max(deadline - time.monotonic(), 0.0)):
            with self._lock:
                self._pings.pop(msg_id, None)
            raise TimeoutError(f"{self._me.name}: worker {name} did not answer a ping within {timeout:g} s")

    # Incoming requests.
    def _enqueue(self, conn: _Connection, msg_id: int, message: Message) -> None:
        """Hand a request to the handler, in the order its peer sent it.

        When none of the peer's requests is queued or being handed over, the
        reader thread calls the handler itself (the RPC layer's handler only
        decodes the request and schedules the call); otherwise it queues the
        request for the peer's strand.
        """
        with self._lock:
            self._in_flight += 1
            strand = self._strands.get(conn.peer.name)
            if strand is None:
                strand = self._strands[conn.peer.name] = _Strand()
            handler = self._handler
            if strand.running or strand.queue or handler is None:
                strand.queue.append((conn, msg_id, message))
                if strand.running or handler is None:
                    return
                strand.running = True
                handler = None
        if handler is None:
            self._submit(self._drain, strand)
        else:
            self._handle(handler, conn, msg_id, message)

    def _handle(self, handler: RequestHandler, conn: _Connection, msg_id: int, message: Message) -> None:
        try:
            reply = handler(conn.peer, message)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            reply = Future()
            _fail(reply, exc)
        if reply.done():
            self._send_reply(conn, msg_id, reply)
        else:
            reply.add_done_callback(functools.partial(self._send_reply, conn, msg_id))

    def _drain(self, strand: _Strand) -> None:
        for _ in range(_STRAND_BATCH):
            with self._lock:
                if not strand.queue:
                    strand.running = False
                    return
                conn, msg_id, message = strand.queue.popleft()
                handler = self._handler
            assert handler is not None
            self._handle(handler, conn, msg_id, message)
        # Let other peers' requests have a worker before continuing with this one.
        self._submit(self._drain, strand)

    def _send_reply(self, conn: _Connection, msg_id: int, reply: Future[Message]) -> None:
        try:
            message = reply.value()
        except Exception:  # noqa: BLE001 - _send_reply_now reports it
            message = None
        if message is None or message.tensors or len(message.payload) > _SMALL_PAYLOAD:
            self._send_reply_now(conn, msg_id, reply)
            return
        frame = small_frame(Kind.REPLY, msg_id, message.payload)
        reading = getattr(_local, "reading", None)
        try:
            with conn.send_lock:
                if conn.closed:
                    return
                conn.batch.append(frame)
                # The reader of conn, with more frames at hand, keeps small replies for one
                # write after the others. Checked under send_lock: _hand_off takes it after
                # moving the reader role, so a reply kept here is never left behind.
                if (
                    reading is not None
                    and reading[0] is conn
                    and conn.reader is reading[1]
                    and len(conn.batch) < _BATCH_FRAMES
                    and conn.stream.has_frame()
                ):
                    return
                data, conn.batch = b"".join(conn.batch), []
                conn.sock.sendall(data)
        except OSError as exc:
            logger.debug("%s: replies to %s lost: %s", self._me.name, conn.peer.name, exc)
        finally:
            self._reply_sent()

    def _reply_sent(self) -> None:
        """One call fewer in flight; wake the idle waits when none is left."""
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle_waits:
                self._cond.notify_all()

    def _send_reply_now(self, conn: _Connection, msg_id: int, reply: Future[Message]) -> None:
        try:
            try:
                message = reply.value()
                prepared = []
                if message.tensors:
                    with self._lock:
                        reverse = self._reverse_maps.get(conn.peer.name, {})
                    prepared = [
                        prepare_tensor(t, reverse, conn.peer.name, is_request=False) for t in message.tensors
                    ]
                self._write(conn, Kind.REPLY, msg_id, message.payload, prepared)
            except (OSError, FrameError):
                raise
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self._write(conn, Kind.ERROR, msg_id, f"{type(exc).__name__}: {exc}".encode(), [])
        except (OSError, FrameError) as exc:
            logger.debug("%s: reply %d to %s lost: %s", self._me.name, msg_id, conn.peer.name, exc)
        finally:
            self._reply_sent()

    # Per-call timeouts.
    def _deadline_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (not self._deadlines or self._deadlines[0][0] > time.monotonic()):
                    delay = self._deadlines[0][0] - time.monotonic() if self._deadlines else 1.0
                    self._timer.wait(min(delay, 1.0))
                if self._closed:
                    return
                _, _, conn, msg_id, timeout = heapq.heappop(self._deadlines)
                entry = conn.pending.pop(msg_id, None)
                if entry is not None:
                    self._in_flight -= 1
                    self._cond.notify_all()
            if entry is not None:
                if conn.shm is not None:
                    conn.shm.release(entry.shm_tokens)
                entry.deliver(
                    TimeoutError(
                        f"{entry.what}: no reply within {timeout:g} s; pass a larger timeout, "
                        "or timeout=0 to wait without limit"
                    ),
                )


_READ_FOR_CODE: Final = TensorPipeAgent._read_for.__code__
