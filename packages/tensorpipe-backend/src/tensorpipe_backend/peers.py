"""Connection set-up: dialling a peer, accepting and authenticating one, and closing one.

One authenticated connection per pair of workers carries requests and
replies both ways: a Unix socket between workers of one host (found through
their published host identity), TCP otherwise, with a second TCP connection,
its lane, for the bytes of large tensors (:mod:`tensorpipe_backend.lane`).
When two workers dial each other at once, the dial of the lower rank wins
and the other is told to use it. Every connection and lane starts with the
HMAC handshake of :mod:`tensorpipe_backend.auth`; nothing is read from a peer
before it passed.

A connection that closes without its peer's goodbye is probed: one connect
finds out at once whether the peer's process ended (nobody listens: the peer
is lost, see :mod:`tensorpipe_backend.liveness`) or only the connection did
(its listener greets; the probe goes no further, the next call dials). A dial
refused, or unanswered for the liveness timeout, judges the peer lost as
well; a peer judged lost is refused when it dials back.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Final

from rpc_registry import WorkerInfo
from rpc_registry.errors import WorkerNameError

from .auth import (
    HELLO_BYTES,
    AuthenticationError,
    HandshakeCut,
    HandshakeStatus,
    PeerIdentity,
    client_handshake,
    server_handshake,
)
from .calls import Calls
from .connection import Connection
from .group import WorkerRecord
from .lane import LANE_CONFIRM, lane_of, lane_rank
from .reader import Readers
from .transport import close_socket, connection_source, dial_local, shared_files, tune
from .wire import recv_exact

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["Peers", "RefusedError"]

_HANDSHAKE_TIMEOUT: Final = 30.0  # for a dial: the peer may be busy starting
# For a connection accepted: the whole handshake, however slowly its bytes trickle in.
_HANDSHAKE_DEADLINE: Final = 10.0
_MAX_HANDSHAKES: Final = 64
_MAX_HANDSHAKES_PER_SOURCE: Final = 16
_REJECTION_WARNING_INTERVAL: Final = 10.0
_MIN_REDIAL: Final = 0.2  # the least time left worth another dial of a peer that cut a handshake
_MAX_UNBOUND_CUTS: Final = 3  # busy answers to one dial that came before our proof (replayable)
_LANE_DIAL_TIMEOUT: Final = 5.0  # the peer just accepted the connection: its lane is as quick
# How long the probe of a closed connection may take. A dead process's address refuses at once;
# a peer that does not greet within this is not judged by the probe (later dials may).
_PROBE_LIMIT: Final = 2.0


class RefusedError(ConnectionError):
    """A peer refuses this worker: it judged this worker lost."""


class Peers:
    """This worker's connections, one per peer, by name.

    ``me`` is this worker and ``secret`` the job's; ``lock`` and ``cond`` are
    the agent's. ``record`` finds a peer's published record (``None``: not in
    the group), ``mine`` this worker's own. ``left`` (shared with the agent)
    says why each departed peer left, and ``lost`` holds the records of the
    peers judged lost, which are refused. ``spawn`` starts a named thread.
    ``judge(peer, why)`` judges a peer lost and returns the reason now in
    ``left`` (``None``: not judged, e.g. while shutting down).
    ``liveness_timeout`` (``0``: none) is how long a dial may go unanswered
    before its peer is judged lost.
    """

    def __init__(
        self,
        me: WorkerInfo,
        secret: bytes,
        lock: threading.RLock,
        cond: threading.Condition,
        record: Callable[[str], WorkerRecord | None],
        mine: Callable[[], WorkerRecord | None],
        left: dict[str, str],
        lost: dict[str, WorkerRecord],
        calls: Calls,
        readers: Readers,
        spawn: Callable[..., None],
        judge: Callable[[WorkerInfo, str], str | None],
        liveness_timeout: float = 0.0,
    ) -> None:
        self._me = me
        self._secret = secret
        self._lock = lock
        self._cond = cond
        self._record = record
        self._mine = mine
        self._left = left
        self._lost = lost
        self._calls = calls
        self._readers = readers
        self._spawn = spawn
        self._judge = judge
        self._liveness_timeout = liveness_timeout
        self.conns: dict[str, Connection] = {}
        self._dialing: set[str] = set()
        # Sockets accepted and not yet authenticated, oldest first: when: (start, source).
        self._handshaking: dict[socket.socket, tuple[float, str]] = {}
        self._cut_handshakes: set[socket.socket] = set()  # told busy by their threads
        self._last_rejection_warning = -_REJECTION_WARNING_INTERVAL
        self._rejections_unsaid = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def close(self) -> None:
        """Refuse new connections from now on (hold ``lock``)."""
        self._closed = True

    def snapshot(self) -> list[Connection]:
        """The connections now open (or closing)."""
        with self._lock:
            return list(self.conns.values())

    def connection(self, name: str, deadline: float | None) -> Connection:
        """The connection to worker ``name``, dialled if there is none (until ``deadline``)."""
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        raise RuntimeError(f"{self._me.name}: the agent is shut down")
                    conn = self.conns.get(name)
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
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self._me.name}: timed out waiting for a connection to worker {name}, which still "
                    "holds an earlier one with this worker"
                )
            with self._lock:
                self._cond.wait_for(lambda: name in self.conns, timeout=0.05)

    def _wait(self, deadline: float | None, what: str) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(f"{self._me.name}: timed out waiting for {what}")
        self._cond.wait(timeout=remaining if remaining is not None else 1.0)

    def _dial(self, name: str, deadline: float | None) -> Connection | None:
        record = self._record(name)
        if record is None:
            raise WorkerNameError(
                f"worker {name!r} is not in the group (could not find destination); it may have left"
            )
        started = time.monotonic()
        # A live member answers a dial in milliseconds: one silent for the liveness timeout is lost.
        window = self._liveness_timeout or _HANDSHAKE_TIMEOUT
        limit = window if deadline is None else max(min(deadline - started, window), 0.01)
        info = WorkerInfo(name, record.rank)
        delay, cuts, unbound = 0.002, 0, 0
        while True:
            try:
                sock, status = self._dial_once(info, record, started + limit)
                break
            except HandshakeCut as cut:
                # Cut to make room for a flood of other connections: dial again, while the limit
                # lasts. A busy answer not bound to our proof may be a recorded one: a few at most.
                cuts, unbound = cuts + 1, unbound + (not cut.fresh)
                remaining = started + limit - time.monotonic()
                if remaining < _MIN_REDIAL or unbound > _MAX_UNBOUND_CUTS:
                    raise ConnectionError(
                        f"worker {name} (rank {record.rank}) cut {cuts} handshakes with {self._me.name} in a "
                        f"row, over {time.monotonic() - started:.1f} s, to make room for other connections (a "
                        "flood of connections from this worker's address or user, or from many); it answers, "
                        "so it is not judged lost"
                    ) from cut
            time.sleep(min(delay * random.uniform(0.5, 1.5), remaining - _MIN_REDIAL))
            delay = min(delay * 2, 0.1)
        if status is HandshakeStatus.DUPLICATE:
            close_socket(sock)
            return None
        if status is HandshakeStatus.REFUSED:
            close_socket(sock)
            me = self._me.name
            raise RefusedError(
                f"worker {name} (rank {record.rank}) refuses {me}: it judged {me} lost (its connection "
                f"closed, or it sent nothing for the liveness timeout); shut {me} down (in a dynamic "
                "group it may then join again)"
            )
        sock.settimeout(None)
        conn = Connection(
            WorkerInfo(name, record.rank), sock, shared_files(self._mine(), record, sock), self._spawn
        )
        with self._lock:
            closed = self._closed
            if not closed:
                old = self.conns.get(name)
                self.conns[name] = conn
                self._cond.notify_all()
        if closed:  # shut down while dialling: the shutdown did not see this connection
            self.drop(conn, "this worker shut down while connecting")
            raise RuntimeError(f"{self._me.name}: the agent is shut down")
        if old is not None and old is not conn:
            self.drop(old, "replaced by a new connection")
        self._readers.start(conn)
        if conn.shm is None and sock.family != socket.AF_UNIX and conn.lane.claim():
            self._spawn(self._dial_lane, f"lane-{name}", conn, record)
        return conn

    def _dial_once(
        self, peer: WorkerInfo, record: WorkerRecord, until: float
    ) -> tuple[socket.socket, HandshakeStatus]:
        """Dial ``peer`` and pass the handshake by ``until`` (monotonic): the socket and the
        verdict. Raises :class:`HandshakeCut` when the peer cut the handshake (dial again)."""
        started = time.monotonic()
        limit = max(until - started, 0.01)
        try:
            sock = dial_local(self._mine(), record, limit) or socket.create_connection(
                (record.host, record.port), timeout=limit
            )
        except OSError as exc:
            if isinstance(exc, ConnectionRefusedError):
                why = f"nothing listens at its address any more ({exc}): its process ended"
                raise ConnectionError(self._lost_text(peer, why)) from exc
            self._judge_silence(peer, started, exc)
            raise ConnectionError(
                f"worker {peer.name} (rank {peer.id}) at {record.host}:{record.port} is unreachable: {exc}"
            ) from exc
        try:
            tune(sock)
            me = PeerIdentity(self._me.name, self._me.id)
            _, status = client_handshake(sock, self._secret, me, PeerIdentity(peer.name, peer.id))
        except (OSError, EOFError, struct.error) as exc:
            close_socket(sock)
            if isinstance(exc, (HandshakeCut, AuthenticationError)):
                raise
            self._judge_silence(peer, started, exc)
            raise ConnectionError(
                f"worker {peer.name}: connecting failed during authentication ({exc})"
            ) from exc
        return sock, status

    def _lost_text(self, peer: WorkerInfo, why: str) -> str:
        """Judge ``peer`` lost because of ``why``; the text of the error that says so."""
        reason = self._judge(peer, why)
        return f"worker {peer.name} {reason}" if reason else f"worker {peer.name} (rank {peer.id}): {why}"

    def _judge_silence(self, peer: WorkerInfo, started: float, exc: BaseException) -> None:
        """Judge ``peer`` lost if a dial that began at ``started`` failed with ``exc`` after waiting
        the whole liveness timeout."""
        waited = time.monotonic() - started
        timeout = self._liveness_timeout
        if timeout and waited >= timeout and isinstance(exc, TimeoutError):
            self._judge(
                peer, f"it did not answer a connection for {waited:.1f} s (liveness_timeout={timeout:g})"
            )

    def probe(self, peer: WorkerInfo) -> str | None:
        """Find out whether ``peer``, whose connection closed without a goodbye, still listens; what
        its calls fail with, after ``worker <name>`` (``None``: it listens, or did not tell within
        the probe's limit).

        A listening worker greets a connection at once (the handshake's hello):
        the probe reads that and hangs up, making no connection. Nobody
        listening judges the peer lost. A process that is ending may still
        accept a connection and then reset it: that is tried again, until its
        listener refuses.
        """
        record = self._record(peer.name)
        if record is None or record.rank != peer.id:
            with self._lock:
                return self._left.get(peer.name)
        deadline = time.monotonic() + min(self._liveness_timeout or _PROBE_LIMIT, _PROBE_LIMIT)
        delay = 0.002
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                sock = dial_local(self._mine(), record, remaining) or socket.create_connection(
                    (record.host, record.port), timeout=remaining
                )
            except ConnectionRefusedError as exc:
                self._judge(peer, f"nothing listens at its address any more ({exc}): its process ended")
                break
            except OSError as exc:
                logger.debug("%s: probing %s: %s", self._me.name, peer.name, exc)
                break
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                recv_exact(sock, HELLO_BYTES)
                break  # it greets: alive
            except (OSError, EOFError) as exc:
                logger.debug("%s: probing %s: %s", self._me.name, peer.name, exc)
            finally:
                close_socket(sock)
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 2, 0.1)
        with self._lock:
            return self._left.get(peer.name)

    def _dial_lane(self, conn: Connection, record: WorkerRecord) -> None:
        """Give ``conn`` (TCP, to another host, its lane claimed) its lane; without one it carries
        everything."""
        try:
            port = conn.sock.getsockname()[1]
            sock = socket.create_connection((record.host, record.port), timeout=_LANE_DIAL_TIMEOUT)
        except OSError as exc:
            logger.debug("%s: no lane to %s: %s", self._me.name, conn.peer.name, exc)
            return
        try:
            tune(sock)
            me = PeerIdentity(self._me.name, lane_rank(self._me.id, port))
            _, status = client_handshake(sock, self._secret, me, PeerIdentity(conn.peer.name, record.rank))
            if status is not HandshakeStatus.ACCEPTED:
                raise ConnectionError("the peer keeps the connection without a lane")
            sock.sendall(LANE_CONFIRM)
        except (OSError, EOFError, struct.error) as exc:
            close_socket(sock)
            logger.debug("%s: no lane to %s: %s", self._me.name, conn.peer.name, exc)
            return
        sock.settimeout(None)
        conn.lane.attach(sock)

    def accept_loop(self, listener: socket.socket) -> None:
        """Accept connections on ``listener`` until closed; each is authenticated in its own thread,
        which then reads it.

        Handshakes in progress are bounded (64, 16 per source address or
        local user) without refusing anyone: past a bound, the oldest
        unauthenticated connection (of that source, or of all) is cut, and
        so is any whose handshake takes longer than 10 s. A member's
        handshake takes milliseconds, so slow or silent strangers cannot
        keep it out; a member's cut by a flood of connections from its own
        source is told busy, and dials again.
        """
        while not self._closed:
            try:
                sock, address = listener.accept()
            except TimeoutError:
                self._cut_slow_handshakes()
                continue
            except OSError:
                if self.closed:
                    return
                time.sleep(0.05)
                continue
            source = connection_source(sock, address)
            with self._lock:
                if self.closed:
                    sock.close()
                    continue
                self._cut_slow_handshakes()
                same = [s for s, (_, src) in self._handshaking.items() if src == source]
                if len(same) >= _MAX_HANDSHAKES_PER_SOURCE:
                    self._cut(same[0], "too many handshakes from one source")
                elif len(self._handshaking) >= _MAX_HANDSHAKES:
                    self._cut(next(iter(self._handshaking)), "too many handshakes")
                self._handshaking[sock] = (time.monotonic(), source)
            self._spawn(self._serve, "serve", sock, source)

    def _cut_slow_handshakes(self) -> None:
        with self._lock:
            expired = time.monotonic() - _HANDSHAKE_DEADLINE
            for sock, (start, _) in list(self._handshaking.items()):
                if start > expired:
                    break  # oldest first
                self._cut(sock, f"no proof within {_HANDSHAKE_DEADLINE:g} s")

    def _cut(self, sock: socket.socket, why: str) -> None:
        """End an unauthenticated handshake (hold ``lock``): its thread's read ends, and it tells
        the client busy (which may be a member, that then dials again)."""
        _, source = self._handshaking.pop(sock)
        self._cut_handshakes.add(sock)
        logger.info("%s: cut an unauthenticated connection from %s: %s", self._me.name, source, why)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)  # not closed here: its thread still uses the descriptor

    def _serve(self, sock: socket.socket, source: str) -> None:
        conn: list[Connection] = []
        lane_of_conn: list[Connection] = []
        proved: list[PeerIdentity] = []  # the client proved the secret

        def decide(peer: PeerIdentity) -> HandshakeStatus:
            proved.append(peer)
            with self._lock:  # authenticated: no longer one of the handshakes that may be cut
                if self._handshaking.pop(sock, None) is None:
                    return HandshakeStatus.BUSY  # cut meanwhile (too slow, or too many at once)
            lane = lane_of(peer.rank)
            rank, port = (peer.rank, None) if lane is None else lane
            record = self._record(peer.name)
            lost = self._lost.get(peer.name)
            if lost is not None and lost.rank == rank and (record is None or record == lost):
                logger.info(
                    "%s: refused %s, which it judged lost", self._me.name, PeerIdentity(peer.name, rank)
                )
                return HandshakeStatus.REFUSED
            if record is None or record.rank != rank:
                raise AuthenticationError(f"{PeerIdentity(peer.name, rank)} is not a member of the group")
            with self._lock:
                if self._closed:
                    raise AuthenticationError("this worker is shutting down")
                if port is not None:
                    # The lane of the TCP connection this peer dialled from that port: one at most.
                    existing = self.conns.get(peer.name)
                    if existing is None or existing.closed or not _dialled_from(existing, port):
                        return HandshakeStatus.DUPLICATE
                    if existing.shm is not None or not existing.lane.claim():
                        return HandshakeStatus.DUPLICATE
                    lane_of_conn.append(existing)
                    return HandshakeStatus.ACCEPTED
                existing = self.conns.get(peer.name)
                if existing is not None and not existing.closed:
                    return HandshakeStatus.DUPLICATE
                if peer.name in self._dialing and self._me.id < peer.rank:
                    return HandshakeStatus.DUPLICATE
                new = Connection(
                    WorkerInfo(peer.name, peer.rank),
                    sock,
                    shared_files(self._mine(), record, sock),
                    self._spawn,
                )
                # Nothing may be sent on it before the verdict.
                new.send_lock.acquire()
                self.conns[peer.name] = new
                self._cond.notify_all()
                conn.append(new)
                return HandshakeStatus.ACCEPTED

        def was_cut() -> bool:
            with self._lock:
                return sock in self._cut_handshakes

        try:
            sock.settimeout(_HANDSHAKE_DEADLINE)
            tune(sock)
            me = PeerIdentity(self._me.name, self._me.id)
            server_handshake(sock, self._secret, me, decide, was_cut)
        except (OSError, EOFError, struct.error, ValueError) as exc:
            with self._lock:  # closed below: the accept loop must not cut it any more
                self._handshaking.pop(sock, None)
                self._cut_handshakes.discard(sock)
            if conn:
                conn[0].send_lock.release()
                self.drop(conn[0], f"authentication failed ({exc})")
            else:
                close_socket(sock)
            # A client that hangs up or stalls before its proof (a probe, a scanner) is no threat worth
            # a warning; a stranger's garbage is worth one now and then, a member's failure always.
            if isinstance(exc, (EOFError, TimeoutError)) and not proved:
                logger.debug("%s: rejected a connection from %s: %s", self._me.name, source, exc)
            else:
                self._warn_rejection(f"from {source}: {exc}", throttled=not proved)
            return
        finally:
            with self._lock:
                self._handshaking.pop(sock, None)
                self._cut_handshakes.discard(sock)
        if lane_of_conn:
            self._attach_lane(lane_of_conn[0], sock)
            return
        if not conn:
            close_socket(sock)
            return
        sock.settimeout(None)
        conn[0].send_lock.release()
        self._readers.read_loop(conn[0], conn[0].reader)

    def _warn_rejection(self, why: str, throttled: bool) -> None:
        """Warn of a rejected connection; those of strangers at most once per 10 s, counting those
        left out (a flood of garbage must not flood the log)."""
        level = logging.WARNING
        if throttled:
            with self._lock:
                now = time.monotonic()
                if now - self._last_rejection_warning < _REJECTION_WARNING_INTERVAL:
                    self._rejections_unsaid += 1
                    level = logging.DEBUG
                else:
                    self._last_rejection_warning = now
                    unsaid, self._rejections_unsaid = self._rejections_unsaid, 0
                    if unsaid:
                        why += f" (and {unsaid} more from strangers since the last such warning)"
        logger.log(level, "%s: rejected a connection %s", self._me.name, why)

    def _attach_lane(self, conn: Connection, sock: socket.socket) -> None:
        """Attach the lane accepted on ``sock`` to ``conn`` once its dialler confirms it."""
        try:
            confirmed = recv_exact(sock, len(LANE_CONFIRM)) == LANE_CONFIRM  # within the handshake's time
        except (OSError, EOFError) as exc:
            logger.debug("%s: a lane of %s was not confirmed: %s", self._me.name, conn.peer.name, exc)
            confirmed = False
        if not confirmed:
            close_socket(sock)
            return
        sock.settimeout(None)
        conn.lane.attach(sock)

    def drop(self, conn: Connection, reason: str, probe: bool = False) -> None:
        """Close ``conn`` and fail its pending calls, naming the peer and ``reason``.

        With ``probe`` (the connection ended or failed, and not because of this
        worker), a peer that did not say goodbye is probed first (see
        :meth:`probe`): if it was lost, its calls fail saying so.
        """
        current = False
        with self._lock:
            conn.closed = True
            if self.conns.get(conn.peer.name) is conn:
                del self.conns[conn.peer.name]
                current = True
            pending = self._calls.detach(conn)
            left = self._left.get(conn.peer.name)
        close_socket(conn.sock)
        conn.outbox.close()
        conn.lane.close()
        if conn.shm is not None:
            conn.shm.close()
        name = conn.peer.name
        if current and probe and left is None and not self._closed:
            left = self.probe(conn.peer)
        for entry in pending.values():
            text = f"worker {name} {left}" if left else f"worker {name} (rank {conn.peer.id}): {reason}"
            entry.deliver(ConnectionError(f"{text}; {entry.what} did not complete"))


def _dialled_from(conn: Connection, port: int) -> bool:
    """Whether ``conn`` is a TCP connection its peer dialled from local port ``port``."""
    if conn.sock.family == socket.AF_UNIX:
        return False
    try:
        return bool(conn.sock.getpeername()[1] == port)
    except OSError:
        return False
