"""A small real RPC backend for the tests: an agent over TCP sockets on 127.0.0.1.

Each worker listens on a port the OS picks and publishes it in the store of
the rendezvous. One connection per ordered pair of workers carries requests
one way and replies the other, so a peer's requests arrive in order. Also
holds the functions that the tests call on other workers.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import pickle
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.distributed_c10d import Store
from torch.futures import Future

from rpc_registry import (
    BackendType,
    Message,
    RequestHandler,
    RpcBackendOptions,
    RRef,
    WorkerInfo,
    backend_registered,
    init_rpc,
    register_backend,
    rpc_async,
    shutdown,
)
from rpc_registry.functions import async_execution

BACKEND_NAME = "SOCKET_TEST"
_HEADER = 8


@dataclass
class SocketOptions:
    """Options of the socket backend."""

    rpc_timeout: float = 20.0
    init_method: str = "env://"
    rendezvous_timeout: float | None = None


def construct_options(rpc_timeout: float, init_method: str, **kwargs: Any) -> SocketOptions:
    if kwargs:
        raise TypeError(f"the socket backend takes no options {sorted(kwargs)}")
    return SocketOptions(rpc_timeout, init_method)


def init_agent(
    store: Store,
    name: str,
    rank: int,
    world_size: int | None,
    rpc_backend_options: RpcBackendOptions,
) -> SocketAgent:
    return SocketAgent(store, name, rank, world_size, rpc_backend_options.rpc_timeout)


def socket_backend() -> BackendType:
    """The socket backend, registered in this process on first use."""
    if not backend_registered(BACKEND_NAME):
        register_backend(BACKEND_NAME, construct_options, init_agent)
    return BackendType[BACKEND_NAME]


def fail(fut: Future[Any], exc: BaseException) -> None:
    """Complete ``fut`` with ``exc`` (torch's stub types the argument as the value)."""
    fut.set_exception(exc)


def _send_frame(sock: socket.socket, lock: threading.Lock, obj: object) -> None:
    data = pickle.dumps(obj)
    with lock:
        sock.sendall(len(data).to_bytes(_HEADER, "big") + data)


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        try:
            chunk = sock.recv(size - len(chunks))
        except OSError:
            return None
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def _recv_frame(sock: socket.socket) -> Any:
    header = _recv_exact(sock, _HEADER)
    if header is None:
        return None
    data = _recv_exact(sock, int.from_bytes(header, "big"))
    return None if data is None else pickle.loads(data)


class _Outgoing:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.pending: dict[int, Future[Message]] = {}


class SocketAgent:
    """An ``RpcAgent`` over sockets; ``world_size=None`` looks peers up in the store."""

    def __init__(
        self, store: Store, name: str, rank: int, world_size: int | None, rpc_timeout: float
    ) -> None:
        self._store = store
        self._me = WorkerInfo(name, rank)
        self._world_size = world_size
        self._rpc_timeout = rpc_timeout
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[WorkerInfo, int]] = {}
        self._outgoing: dict[str, _Outgoing] = {}
        self._incoming: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count()
        self._handler: RequestHandler | None = None
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._barriers = itertools.count()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        store.set(f"agent/name/{name}", f"{rank}:{self._listener.getsockname()[1]}")
        store.set(f"agent/rank/{rank}", name)
        self._spawn(self._accept_loop)
        if world_size is not None:
            keys = [f"agent/rank/{r}" for r in range(world_size)]
            store.wait(keys, timedelta(seconds=rpc_timeout))
            for r in range(world_size):
                self._lookup(store.get(f"agent/rank/{r}").decode())

    @property
    def rpc_timeout(self) -> float:
        return self._rpc_timeout

    def start(self, handler: RequestHandler) -> None:
        self._handler = handler
        self._started.set()

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        if worker_name is None:
            return self._me
        return self._lookup(worker_name)[0]

    def get_worker_infos(self) -> list[WorkerInfo]:
        with self._lock:
            return sorted({info for info, _ in self._peers.values()} | {self._me}, key=lambda i: i.id)

    def send(self, to: WorkerInfo, message: Message, timeout: float) -> Future[Message]:
        conn = self._connection(to.name)
        fut: Future[Message] = Future()
        msg_id = next(self._ids)
        with conn.lock:
            conn.pending[msg_id] = fut
        _send_frame(conn.sock, conn.lock, (msg_id, message.payload, message.tensors))
        return fut

    def sync(self) -> None:
        self._barrier(self._rpc_timeout)

    def join(self, shutdown: bool = False, timeout: float = 0) -> None:
        self._barrier(timeout)

    def shutdown(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            socks = [conn.sock for conn in self._outgoing.values()] + self._incoming
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(timeout=10)

    def _barrier(self, timeout: float) -> None:
        if self._world_size is None:
            return
        key = f"agent/barrier/{next(self._barriers)}"
        self._store.add(key, 1)
        deadline = time.monotonic() + (timeout if timeout > 0 else self._rpc_timeout)
        while self._store.add(key, 0) < self._world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key}: not all {self._world_size} workers arrived in time")
            time.sleep(0.01)
        # Rank 0 hosts the store: it must stay until every worker has seen the barrier pass.
        self._store.add(f"{key}/left", 1)
        while self._me.id == 0 and self._store.add(f"{key}/left", 0) < self._world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key}: not all workers left the barrier in time")
            time.sleep(0.01)

    def _lookup(self, name: str) -> tuple[WorkerInfo, int]:
        with self._lock:
            if name in self._peers:
                return self._peers[name]
        key = f"agent/name/{name}"
        if not self._store.check([key]):
            raise ValueError(f"worker_name={name!r}: no such worker in this group")
        rank, port = self._store.get(key).decode().split(":")
        entry = (WorkerInfo(name, int(rank)), int(port))
        with self._lock:
            self._peers[name] = entry
        return entry

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _connection(self, name: str) -> _Outgoing:
        with self._lock:
            conn = self._outgoing.get(name)
            if conn is not None:
                return conn
            port = self._peers[name][1] if name in self._peers else None
        if port is None:
            port = self._lookup(name)[1]
        sock = socket.create_connection(("127.0.0.1", port), timeout=self._rpc_timeout)
        sock.settimeout(None)
        conn = _Outgoing(sock)
        _send_frame(sock, conn.lock, self._me)
        with self._lock:
            if name in self._outgoing:  # another thread connected first
                sock.close()
                return self._outgoing[name]
            self._outgoing[name] = conn
        self._spawn(self._reply_loop, conn, name)
        return conn

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            sock.settimeout(None)
            with self._lock:
                self._incoming.append(sock)
            self._spawn(self._request_loop, sock)

    def _request_loop(self, sock: socket.socket) -> None:
        sender = _recv_frame(sock)
        write_lock = threading.Lock()
        if not self._started.wait(self._rpc_timeout):
            raise TimeoutError(f"{self._me.name}: no request handler within {self._rpc_timeout} s")
        assert self._handler is not None
        while (frame := _recv_frame(sock)) is not None:
            msg_id, payload, tensors = frame
            reply = self._handler(sender, Message(payload, tensors))
            reply.add_done_callback(functools.partial(self._send_reply, sock, write_lock, msg_id))

    def _send_reply(
        self, sock: socket.socket, lock: threading.Lock, msg_id: int, reply: Future[Message]
    ) -> None:
        try:
            message = reply.value()
            frame: tuple[object, ...] = (msg_id, True, message.payload, message.tensors)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            frame = (msg_id, False, f"{type(exc).__name__}: {exc}", ())
        with contextlib.suppress(OSError):  # the caller may be gone
            _send_frame(sock, lock, frame)

    def _reply_loop(self, conn: _Outgoing, name: str) -> None:
        while (frame := _recv_frame(conn.sock)) is not None:
            msg_id, ok, body, tensors = frame
            with conn.lock:
                fut = conn.pending.pop(msg_id)
            if ok:
                fut.set_result(Message(body, tensors))
            else:
                fail(fut, RuntimeError(f"{name} could not handle a request: {body}"))
        with conn.lock:
            pending, conn.pending = conn.pending, {}
        for fut in pending.values():
            fail(fut, ConnectionError(f"connection to {name} closed"))


def run_worker(name: str, rank: int, world_size: int, init_method: str) -> None:
    """Body of a spawned worker: serve requests until every worker shuts down."""
    init_rpc(
        name,
        backend=socket_backend(),
        rank=rank,
        world_size=world_size,
        rpc_backend_options=SocketOptions(rpc_timeout=20.0, init_method=init_method),
    )
    shutdown(graceful=True, timeout=60.0)


# Functions and values that the tests use on other workers.
_LIVE: weakref.WeakSet[Tracked] = weakref.WeakSet()
_HELD: list[RRef[Tracked]] = []


class Tracked:
    """A value whose live instances are counted on the worker that holds them."""

    def __init__(self, value: int) -> None:
        self.value = value
        _LIVE.add(self)

    def get(self) -> int:
        return self.value

    def add(self, n: int) -> int:
        self.value += n
        return self.value


def make_tracked(value: int) -> Tracked:
    return Tracked(value)


_ARRIVAL_GATE = threading.Event()


class SlowToArrive:
    """An argument that arrives on a worker once :func:`let_arrive` runs there: a stand-in for a
    large one (after 10 s without it, it arrives as -1)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Callable[[int], SlowToArrive], tuple[int]]:
        return _arrive, (self.value,)


def _arrive(value: int) -> SlowToArrive:
    let = _ARRIVAL_GATE.wait(10)
    _ARRIVAL_GATE.clear()
    return SlowToArrive(value if let else -1)


def let_arrive() -> None:
    _ARRIVAL_GATE.set()


def tracked_of(arrived: SlowToArrive) -> Tracked:
    return Tracked(arrived.value)


def live_tracked() -> int:
    gc.collect()
    return len(_LIVE)


def hold(rref: RRef[Tracked]) -> bool:
    _HELD.append(rref)
    return rref.is_owner()


def fetch_held() -> int:
    return _HELD[0].to_here().value


def drop_held() -> None:
    _HELD.clear()
    gc.collect()


def value_via_to_here(rref: RRef[Tracked]) -> int:
    return rref.to_here().value


def tracked_copy_of(rref: RRef[Tracked]) -> Tracked:
    return Tracked(rref.to_here().value)


def local_value_if_owner(rref: RRef[Tracked]) -> int | None:
    return rref.local_value().value if rref.is_owner() else None


def pid() -> int:
    return os.getpid()


def raise_value_error(message: str) -> None:
    raise ValueError(message)


def sleep_then(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


@async_execution
def add_one_on(to: str, x: torch.Tensor) -> Future[torch.Tensor]:
    """Asks ``to`` for ``x + 1`` and replies with twice that, without blocking a thread."""
    fut: Future[torch.Tensor] = rpc_async(to, torch.add, args=(x, 1))
    return fut.then(lambda f: f.wait() * 2)
