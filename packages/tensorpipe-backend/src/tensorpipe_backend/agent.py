"""``TensorPipeAgent``: moves ``rpc_registry`` messages between workers over sockets.

The agent wires the rooms that follow one call:

- send: :meth:`TensorPipeAgent.send` registers the call (:mod:`.calls`) and
  writes it on the peer's connection (:mod:`.peers` sets it up over
  :mod:`.transport`);
- frame: :meth:`.connection.Connection.write` frames it (:mod:`.wire`);
- read: the peer's reader thread reads it (:mod:`.reader`);
- dispatch: :meth:`TensorPipeAgent._dispatch` hands a request to
  :mod:`.requests` (through a peer's :mod:`.strands` when earlier ones wait)
  and a reply to :mod:`.calls`;
- reply: :mod:`.requests` sends the handler's reply back, and the caller's
  reader (or, in ``send_wait``, the caller itself) completes the call.

The agent itself holds the group (records, device maps, membership), the
public ``rpc_registry.RpcAgent`` methods and shutdown, and the verdict on a
lost peer (:meth:`TensorPipeAgent._judge`; how a loss is found is
:mod:`.liveness`): a peer whose process ended is judged lost as soon as its
connection closes, a frozen one once it sent nothing for ``liveness_timeout``.
From then on:

- its pending calls and every later call to it fail at once with a
  ``ConnectionError`` that names it, its rank and why it was lost (in a
  dynamic group, naming it in a call raises ``WorkerNameError`` saying so);
- ``get_worker_infos()`` no longer lists it; in a dynamic group,
  ``get_worker_info(name)`` raises, and the first survivor to judge it takes
  it out of the member list in the store and frees its name, so that other
  workers and those joining later do not see it either;
- it is refused if it comes back (a frozen process that resumes): it must
  shut down, and may then join a dynamic group again;
- a static group's graceful shutdown goes on without it (rank 0 does not wait
  for it; if rank 0 itself was lost, each survivor waits for its own calls
  only, and says so in the log).

Calls between the survivors go on. A host that vanished is noticed by TCP
keepalive and ``TCP_USER_TIMEOUT`` (about four seconds).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

import torch
from torch.distributed.distributed_c10d import Store
from torch.futures import Future

from join_core import spare_connections
from rpc_registry import Message, RequestHandler, WorkerInfo
from rpc_registry.errors import WorkerNameError

from .address import ADDR_ENV, check_reachable, listen_host
from .calls import Calls, Reply
from .connection import KEEPALIVES, Connection, prepare_tensor
from .device_maps import create_device_list, create_reverse_mapping, validate_device_maps
from .group import (
    WorkerRecord,
    gather_signed_records,
    members,
    membership_token,
    nobody_listens,
    publish_signed_record,
    read_record,
    record_key,
    remove_lost_member,
    report_failure,
    set_members,
    static_group_met,
)
from .liveness import Liveness
from .options import DeviceMap, TensorPipeRpcBackendOptions
from .peers import Peers
from .pending import Pending, ReplySink
from .reader import Readers, reading
from .requests import Requests
from .rounds import GroupRounds, RoundFailedError
from .secret import resolve_secret
from .secret_file import forget_secret_file
from .shm import host_identity
from .strands import call_out, running
from .transport import local_listener
from .watch import Watch
from .wire import FrameError, Kind

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["ADDR_ENV", "TensorPipeAgent", "get_current_agent", "prepare_tensor"]

_current: weakref.ref[TensorPipeAgent] | None = None
# How long a shutdown whose rank 0 failed a round waits for the verdict that rank 0 is gone.
_VERDICT_WAIT: Final = 2.0
#: Seconds a shutdown waits for its goodbyes to go out; a peer that reads nothing (stopped,
#: its socket full) is not waited for longer: the close that follows cuts its connection.
_GOODBYE_WAIT: Final = 5.0
_THREADS_WAIT: Final = 5.0
# torch's wording, which callers may match; the fix follows it.
_MIXED_GROUP: Final = (
    "RPC group mixes statically and dynamically initialized members which is not supported. "
    "Every worker meeting at one init_method passes world_size (a static group) or none does (a dynamic "
    "group)"
)


def get_current_agent() -> TensorPipeAgent:
    """The agent most recently created in this process, if it is still running."""
    agent = _current() if _current is not None else None
    if agent is None or agent.is_shut_down:
        raise RuntimeError(
            "no TensorPipeAgent is running in this process: call rpc_registry.init_rpc() first"
        )
    return agent


class TensorPipeAgent:
    """An ``rpc_registry.RpcAgent`` over authenticated sockets; see the module docstring.

    Created by the backend's init handler (through ``rpc_registry.init_rpc``),
    which passes the rendezvous ``store``. ``world_size=None`` joins a dynamic
    group. The constructor returns once this worker is reachable and, in a
    static group, every worker has checked the group's device maps.
    """

    handler_may_block: Final = True
    """The request handler may run the called function before it returns (see
    ``rpc_registry.protocols.RpcAgent``): a reader thread, or a strand's runner,
    whose call calls out or runs past four watch ticks (20 ms) hands its socket,
    or the strand, to a new thread."""

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
        self._records: dict[str, WorkerRecord] = {}
        self._infos: dict[str, tuple[WorkerRecord, WorkerInfo]] = {}  # get_worker_info's, per record
        self._left: dict[str, str] = {}
        self._lost: dict[str, WorkerRecord] = {}  # the peers judged lost, and which incarnation
        self._pings: dict[int, threading.Event] = {}
        self._closed = False
        self._said_goodbye = False
        # The end of the last join()'s timeout: the goodbyes of the shutdown that follows wait no longer.
        self._join_deadline: float | None = None
        self._threads: list[threading.Thread] = []
        self._device_maps = options.device_maps
        self._reverse_maps: dict[str, DeviceMap] = {}
        self._devices: list[torch.device] = []
        self._cuda_count = torch.cuda.device_count()
        self._pool = ThreadPoolExecutor(options.num_worker_threads, thread_name_prefix=f"tpb-{name}")
        self._listener: socket.socket | None = None
        self._local_listener: socket.socket | None = None
        self._unspare: Callable[[], None] | None = None
        self._rounds: GroupRounds | None = None
        self._calls = calls = Calls(name, lock, self._cond, self._spawn)
        self._watch = watch = Watch()
        self._requests = Requests(
            name, lock, calls, self._pool, self._reverse_map, watch, self._leave_reading
        )
        self._readers = Readers(
            name,
            self._cuda_count,
            calls,
            self._dispatch,
            self._drop,
            self._spawn,
            self._connections,
            watch,
        )
        watch.add(self._readers)
        self._peers: Peers | None = None
        self._liveness: Liveness | None = None
        # The secret's files this worker wrote: a static group's go with it; a dynamic group's
        # stay while this process runs (a copy for later joiners, and for its own next join).
        self._secret_files: list[Path] = []
        self._static = world_size is not None
        try:
            self._secret = secret = resolve_secret(
                options.auth_token,
                store,
                rank,
                world_size is not None,
                self._init_timeout,
                options.insecure,
                name,
                self._holders() if world_size is None else (),
                self._secret_files,
            )
            self._peers = peers = Peers(
                self._me,
                secret,
                lock,
                self._cond,
                self._record,
                self._mine,
                self._left,
                self._lost,
                calls,
                self._readers,
                self._spawn,
                self._judge,
                options.liveness_timeout if KEEPALIVES else 0.0,
            )
            host = listen_host(options.init_method)
            self._listener = socket.create_server((host, 0))
            self._listener.settimeout(0.2)
            # A Join that goes on without a lost rank shuts the old process group's
            # connections down: not these, which the survivors' calls still need.
            self._unspare = spare_connections(self._listener.getsockname()[1])
            shm_host = host_identity()
            self._local_listener = local_listener() if shm_host else None
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
            self._spawn(peers.accept_loop, "accept", self._listener)
            if self._local_listener is not None:
                self._spawn(peers.accept_loop, "accept-local", self._local_listener)
            self._spawn(calls.run_deadlines, "deadlines")
            self._spawn(watch.run, "watch")
            if options.liveness_timeout > 0 and KEEPALIVES:
                self._liveness = Liveness(name, options.liveness_timeout, self._connections, self._silent)
                self._spawn(self._liveness.run, "liveness")
            if world_size is not None:
                self._join_static(record, world_size)
            else:
                self._join_dynamic(record)
        except BaseException as exc:
            self._close_now()
            self._forget_secret_files()
            if world_size is not None and isinstance(exc, Exception):
                report_failure(store, rank, exc)
            raise
        _current = weakref.ref(self)
        logger.debug("agent %s (rank %d) listens on %s:%d", name, rank, host, record.port)

    # Group set-up.
    def _holders(self) -> list[str]:
        """The dynamic group's members (each keeps a copy of the secret), or none if the list is unreadable."""
        try:
            return members(self._store)
        except (ValueError, TypeError) as exc:
            logger.warning("%s: the store's member list is unreadable: %s", self._me.name, exc)
            return []

    @property
    def _init_timeout(self) -> float:
        return self._rpc_timeout if self._rpc_timeout > 0 else 300.0

    def _publish(self, record: WorkerRecord) -> None:
        text = record.to_json()
        current = self._store.compare_set(record_key(record.name), "", text).decode()
        if current != text:
            other = WorkerRecord.from_json(current)
            raise WorkerNameError(
                f"name={record.name!r} is not unique: the worker of rank {other.rank} has it; "
                "give every worker a unique name"
            )
        self._records[record.name] = record

    def _join_static(self, record: WorkerRecord, world_size: int) -> None:
        timeout = self._init_timeout
        if members(self._store):
            raise RuntimeError(_MIXED_GROUP + f": {members(self._store)} joined it without world_size")
        self._records[record.name] = record
        publish_signed_record(self._store, record, self._secret)
        parsed = gather_signed_records(self._store, self._secret, world_size, record.rank, timeout)
        names = [r.name for r in parsed]
        records = {r.name: r for r in parsed}
        if len(records) < world_size:
            duplicate = next(n for n in names if names.count(n) > 1)
            ranks = [r for r, n in enumerate(names) if n == duplicate]
            raise WorkerNameError(
                f"name={duplicate!r} is not unique: the workers of ranks {ranks} have it; "
                "give every worker a unique name"
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
        with membership_token(store, record.name, timeout, address=(record.host, record.port)):
            if static_group_met(store):
                raise RuntimeError(_MIXED_GROUP + f": {record.name} came without world_size")
            current = members(store)
            held = read_record(store, record.name) if record.name in current else None
            if held is not None and nobody_listens((held.host, held.port)):
                # Its process ended without leaving, and no member saw it go (the store outlived them all).
                logger.warning(
                    "%s: the member of this name (rank %d at %s:%d) no longer listens: its process ended; "
                    "this worker takes its place in the group",
                    record.name,
                    held.rank,
                    held.host,
                    held.port,
                )
                current = [name for name in current if name != record.name]
                store.delete_key(record_key(record.name))  # under the token: nobody else writes it
            if record.name in current:
                raise WorkerNameError(
                    f"name={record.name!r} is not unique: a worker of this name is already in the group; "
                    "give every worker a unique name"
                )
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
        self._lost.pop(record.name, None)
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
        try:
            record = read_record(self._store, name)
            if record is None:
                return None
        except RuntimeError:  # the store is unreachable (its host may be lost)
            if name in self._left:
                return None  # it left or was lost: so it stays
            raise
        with self._lock:
            if record == self._lost.get(name):
                return None  # judged lost; its record is about to leave the store
            self._learn(record)
        return record

    def _mine(self) -> WorkerRecord | None:
        return self._records.get(self._me.name)

    def _reverse_map(self, peer: str) -> DeviceMap:
        with self._lock:
            return self._reverse_maps.get(peer, {})

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
        return {
            c.peer.name: "unix" if c.sock.family == socket.AF_UNIX else "tcp"
            for c in self._connections()
            if not c.closed
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
        self._requests.start(handler)

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """The named worker's info, or this worker's.

        Raises:
            WorkerNameError: (a ``ValueError`` and a ``RuntimeError``) no worker of that name is in
                the group, or it left.
        """
        if worker_name is None or worker_name == self._me.name:
            return self._me
        record = self._records.get(worker_name) or self._record(worker_name)
        if record is None:
            with self._lock:
                reason = self._left.get(worker_name)
                known = sorted(self._records)
            # torch's wording ("could not find destination") in both, which callers may match.
            if reason is not None:
                raise WorkerNameError(
                    f"worker_name={worker_name!r}: could not find destination: worker {worker_name} {reason}"
                )
            raise WorkerNameError(
                f"worker_name={worker_name!r}: could not find destination: no worker of this name "
                f"in the group (known: {known})"
            )
        cached = self._infos.get(worker_name)
        if cached is not None and cached[0] is record:
            return cached[1]
        info = WorkerInfo(record.name, record.rank)
        self._infos[worker_name] = (record, info)
        return info

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker in the group, this one included, by rank; not those that left or were lost.

        In a dynamic group, the members the store lists, less those this
        worker judged lost (while the store is unreachable: those it knows);
        in a static group, every rank less those that shut down or were lost.
        """
        names = None
        if self._world_size is None and not self._closed:
            try:
                names = members(self._store)
            except (RuntimeError, OSError, ValueError) as exc:  # the store's host may be the one lost
                logger.debug("%s: the store's member list is unreadable: %s", self._me.name, exc)
            for name in names or ():
                self._record(name)
        with self._lock:
            records = self._records
            listed = records if names is None else [n for n in names if n in records]
            infos = {WorkerInfo(records[n].name, records[n].rank) for n in listed if n not in self._left}
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
        reply = Reply()
        sent = self._send(to, message, timeout, reply.set)
        if sent is None:
            return reply.wait()
        conn, msg_id = sent
        try:
            if reply.outcome is None and conn.data_wait is not None:
                self._readers.read_for(
                    conn, msg_id, reply, time.monotonic() + timeout if timeout > 0 else None
                )
            return reply.wait()
        except BaseException:
            # Interrupted (a signal handler raised): nobody waits for the reply any more.
            self._calls.claim(conn, msg_id)
            raise

    def _leave_reading(self) -> None:
        """Where this thread is a reader processing a frame and may now wait (for a reply, or for
        a peer to read what it sends), another thread takes over the reading of its connection."""
        current = getattr(reading, "reading", None)
        if current is not None:
            reading.reading = None
            self._readers.hand_off(*current)

    def _send(
        self, to: WorkerInfo, message: Message, timeout: float, sink: ReplySink
    ) -> tuple[Connection, int] | None:
        """Send a request; the connection it went out on and its id (``None``: ``sink`` already has
        the error)."""
        if self._closed:
            raise RuntimeError(f"{self._me.name}: the agent is shut down; call init_rpc() again to send")
        self._leave_reading()  # a reader calling out will likely wait for the reply
        if getattr(running, "strand", None) is not None:
            call_out()  # likewise, another thread runs the later requests of the peer whose request calls out
        calls = self._calls
        pending = Pending(sink, next(calls.ids), to.name)
        reason = self._left.get(to.name)
        if reason is not None:
            pending.deliver(ConnectionError(f"worker {to.name} {reason}; the call was not sent"))
            return None
        prepared = []
        if message.tensors:
            device_map = self._device_maps.get(to.name, {})
            prepared = [prepare_tensor(t, device_map, to.name, is_request=True) for t in message.tensors]
        deadline = time.monotonic() + timeout if timeout > 0 else None
        peers = self._peers
        if peers is None:
            raise RuntimeError(f"{self._me.name}: the agent is shut down")
        conn = peers.conns.get(to.name)
        if conn is None or conn.closed:
            conn = peers.connection(to.name, deadline)
        msg_id = pending.msg_id
        try:  # a signal handler raising in here (main thread) must not leave the call registered
            if not calls.add(conn, pending, deadline, timeout):
                pending.deliver(ConnectionError(f"worker {to.name}: the connection closed before sending"))
                return None
            try:
                conn.write(Kind.REQUEST, msg_id, message.payload, prepared, pending.shm_tokens)
            except FrameError as exc:  # over a limit, nothing sent: only this call fails
                if calls.claim(conn, msg_id) is not None:
                    pending.deliver(ValueError(f"{pending.what} was not sent: {exc}"))
                return None
            except OSError as exc:
                peers.drop(conn, f"sending to it failed ({exc})", probe=True)
                return None
        except BaseException:
            calls.claim(conn, msg_id)
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
        self._join_deadline = deadline
        if self._world_size is None:
            self._wait_idle(deadline)
            if shutdown:
                self._leave(deadline)
            return
        group, what = self._static_group(), "a shutdown barrier with no call in flight"
        while True:
            remaining = 0.0 if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:
                # Rank 0 does not wait for the workers lost: they have no call in flight any more.
                if group.sum(self._active(), remaining, what, skip_lost=True) == 0:
                    break
            except (RoundFailedError, ConnectionError) as exc:
                if not self._coordinator_gone(group.coordinator):
                    raise
                reason = self._left[group.coordinator]
                logger.warning(
                    "%s: worker %s %s; it is rank 0, through which the group agrees that no call is in "
                    "flight, so this worker waits for its own calls only (%s)",
                    self._me.name,
                    group.coordinator,
                    reason,
                    exc,
                )
                self._wait_idle(deadline)
                break
            self._calls.wait_idle(0.05)
        if shutdown:
            if self._lost:
                lost = ", ".join(sorted(self._lost))
                logger.warning("%s: the group shut down without %s, lost", self._me.name, lost)
            self._goodbye("has shut down")

    def shutdown(self) -> None:
        """Close every connection and stop the threads; pending calls fail naming their peer."""
        self._goodbye("has shut down")
        self._close_now()

    # Dispatch of what a reader read.
    def _dispatch(
        self,
        conn: Connection,
        kind: Kind,
        msg_id: int,
        payload: bytes,
        tensors: tuple[torch.Tensor, ...],
        error: str | None,
    ) -> None:
        if kind is Kind.REQUEST:
            if error is not None:
                conn.post(Kind.ERROR, msg_id, error.encode())
                return
            self._requests.enqueue(conn, msg_id, Message(payload, tensors))
        elif kind is Kind.REPLY or kind is Kind.ERROR:
            self._calls.answer(conn, kind, msg_id, payload, tensors, error)
        elif kind is Kind.PING:
            conn.post(Kind.PONG, msg_id, b"")
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
            reason = payload.decode(errors="replace")[:200]
            with self._lock:
                self._left[conn.peer.name] = reason
                self._cond.notify_all()
                if self._world_size is None:
                    self._records.pop(conn.peer.name, None)
                    self._reverse_maps.pop(conn.peer.name, None)
            rounds = self._rounds
            if rounds is not None:  # its rounds are over: one still waiting for it fails, or skips it
                rounds.lost(conn.peer.id, f"it {reason}")

    def _send_round(self, name: str, number: int, payload: bytes) -> None:
        reason = self._left.get(name)
        if reason is not None:
            raise RoundFailedError(f"worker {name} {reason}")
        peers = self._live_peers()
        conn = peers.connection(name, time.monotonic() + self._init_timeout)
        try:
            conn.write(Kind.GROUP, number, payload, [])
        except OSError as exc:
            peers.drop(conn, f"sending to it failed ({exc})", probe=True)
            raise

    # Lost peers (see the module docstring and .liveness).
    def _judge(self, peer: WorkerInfo, why: str) -> str | None:
        """Judge ``peer`` lost because of ``why``, once; the reason its calls now fail with (its
        earlier one if it already left or was lost; ``None``: not a member, or shutting down)."""
        with self._lock:
            if self._closed:
                return None
            known = self._left.get(peer.name)
            if known is not None:
                return known
            record = self._records.get(peer.name)
            if record is None or record.rank != peer.id or peer.name == self._me.name:
                return None
            reason = f"(rank {peer.id}) was lost: {why}"
            self._left[peer.name] = reason
            self._lost[peer.name] = record
            self._cond.notify_all()
            if self._world_size is None:
                self._records.pop(peer.name, None)
                self._reverse_maps.pop(peer.name, None)
        logger.warning("%s: worker %s %s", self._me.name, peer.name, reason)
        rounds = self._rounds
        if rounds is not None:
            rounds.lost(peer.id, reason)
        if self._world_size is None:
            self._spawn(self._remove_lost, f"remove-{peer.name}", record)
        return reason

    def _coordinator_gone(self, name: str) -> bool:
        """Whether rank 0 (``name``) was lost or shut down. One that died may not be judged yet (its
        connection's closing is being probed): a probe tells, or that one's verdict within its limit."""
        if name in self._left:
            return True
        self._live_peers().probe(WorkerInfo(name, 0))
        with self._lock:
            return self._cond.wait_for(lambda: name in self._left, timeout=_VERDICT_WAIT)

    def _silent(self, conn: Connection, waited: float) -> None:
        """The liveness thread found ``conn``'s peer silent for ``waited`` seconds."""
        timeout = self._options.liveness_timeout
        why = f"it sent nothing for {waited:.1f} s (liveness_timeout={timeout:g})"
        reason = self._judge(conn.peer, why)
        # On a thread of its own: failing the peer's calls runs their futures' callbacks, and
        # one that blocks must not stop this thread's keepalives to every other peer.
        self._spawn(self._live_peers().drop, f"drop-{conn.peer.name}", conn, reason or why)

    def _remove_lost(self, record: WorkerRecord) -> None:
        """Take the lost worker of ``record`` out of the dynamic group in the store."""
        try:
            removed = remove_lost_member(
                self._store, self._me.name, record, self._init_timeout, self._lost_holder, self.address
            )
        except (RuntimeError, OSError, ValueError, TimeoutError) as exc:
            logger.warning(
                "%s: could not take lost worker %s out of the group: %s", self._me.name, record.name, exc
            )
            return
        if removed:
            logger.info("%s: took lost worker %s out of the group", self._me.name, record.name)

    def _lost_holder(self, holder: str) -> bool:
        """Whether the membership token's ``holder`` is a worker judged lost."""
        return holder.split(" (removing ", 1)[0] in self._lost

    def _ping(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        conn = self._live_peers().connection(name, deadline)
        event = threading.Event()
        msg_id = next(self._calls.ids)
        with self._lock:
            self._pings[msg_id] = event
        conn.write(Kind.PING, msg_id, b"", [])
        if not event.wait(max(deadline - time.monotonic(), 0.0)):
            with self._lock:
                self._pings.pop(msg_id, None)
            raise TimeoutError(f"{self._me.name}: worker {name} did not answer a ping within {timeout:g} s")

    # Wiring.
    def _live_peers(self) -> Peers:
        peers = self._peers
        if peers is None:
            raise RuntimeError(f"{self._me.name}: the agent is shut down")
        return peers

    def _connections(self) -> list[Connection]:
        peers = self._peers
        return [] if peers is None else peers.snapshot()

    def _drop(self, conn: Connection, reason: str, probe: bool = False) -> None:
        self._live_peers().drop(conn, reason, probe)

    def _spawn(self, target: Callable[..., None], what: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"tpb-{self._me.name}-{what}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    # Shutdown.
    def _static_group(self) -> GroupRounds:
        group = self._rounds
        if group is None:
            raise RuntimeError(f"{self._me.name}: the agent is shut down")
        return group

    def _active(self) -> int:
        return self._calls.active()

    def _wait_idle(self, deadline: float | None) -> None:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not self._calls.wait_idle(remaining):
            raise TimeoutError(
                f"{self._me.name}: {self._calls.in_flight} calls still in flight when the shutdown timeout "
                "passed; pass a larger timeout or 0 to wait without limit"
            )

    def _leave(self, deadline: float | None) -> None:
        timeout = 0.0 if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            with membership_token(self._store, self._me.name, timeout, self._lost_holder, self.address):
                set_members(self._store, [n for n in members(self._store) if n != self._me.name])
                self._store.delete_key(record_key(self._me.name))
        except TimeoutError:
            raise
        except RuntimeError as exc:  # the store is unreachable: its host (rank 0) was lost, maybe
            host = ", ".join(f"{n} {self._left[n]}" for n in sorted(self._lost)) or "its host is gone"
            logger.warning(
                "%s: could not leave the group in the store (%s; %s); only the connected workers are told",
                self._me.name,
                exc,
                host,
            )
        self._goodbye("left the group")

    def _goodbye(self, reason: str) -> None:
        with self._lock:
            if self._said_goodbye or self._closed:
                return
            self._said_goodbye = True
        # Each goodbye on a thread of its own: one to a peer that reads nothing waits for its
        # socket (or for the send lock of a call stuck on it) until the connection closes.
        wait = _GOODBYE_WAIT
        if self._join_deadline is not None:  # within the timeout of a graceful shutdown
            wait = min(wait, max(self._join_deadline - time.monotonic(), 0.0))
        senders = []
        for conn in self._connections():
            sender = threading.Thread(
                target=_say_goodbye, args=(conn, reason), name=f"tpb-{self._me.name}-goodbye", daemon=True
            )
            sender.start()
            senders.append((conn.peer.name, sender))
        deadline = time.monotonic() + wait
        for _, sender in senders:
            sender.join(max(deadline - time.monotonic(), 0.0))
        untold = sorted(name for name, sender in senders if sender.is_alive())
        if untold:
            logger.warning(
                "%s: %s read nothing for %.1f s; this worker leaves without telling them",
                self._me.name,
                ", ".join(untold),
                wait,
            )

    def _forget_secret_files(self) -> None:
        for path in self._secret_files:
            forget_secret_file(path)
        self._secret_files.clear()

    def _close_now(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._peers is not None:
                self._peers.close()
            if self._liveness is not None:
                self._liveness.close()
            conns = self._connections()
            self._cond.notify_all()
            self._calls.close()
        self._watch.close()
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                listener.close()
        if self._unspare is not None:
            self._unspare()  # the port may go to a process group's connection next
        for conn in conns:
            self._drop(conn, f"this worker ({self._me.name}) shut down")
        if self._rounds is not None:
            self._rounds.close(f"this worker ({self._me.name}) shut down")
        self._pool.shutdown(wait=False, cancel_futures=True)
        threads = [thread for thread in self._threads if thread is not threading.current_thread()]
        deadline = time.monotonic() + _THREADS_WAIT  # for them all: stuck ones are not waited for in turn
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        stuck = [thread.name for thread in threads if thread.is_alive()]
        if stuck:
            logger.warning(
                "threads %s did not stop within %.0f s after shutdown", ", ".join(stuck), _THREADS_WAIT
            )
        if self._static:
            self._forget_secret_files()  # every worker of the group read it during init_rpc


def _say_goodbye(conn: Connection, reason: str) -> None:
    try:
        conn.write(Kind.GOODBYE, 0, reason.encode(), [])
    except (OSError, FrameError):
        logger.debug("could not say goodbye to %s", conn.peer.name)
