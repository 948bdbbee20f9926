"""Liveness of the ranks of a Join: each proves it is alive through the
rendezvous store, and a rank that stops doing so is named to every other.

Why the store: it reaches every rank whatever else is in use (RPC or not),
and it costs no collective, so healthy iterations stay at zero extra ones.

How a waiting main thread gets unblocked: gloo ignores ``ProcessGroup.abort()``
and ``shutdown()`` in torch 2.13 (a pending ``wait()`` goes on until the
group's timeout), and ``work.wait(timeout)`` would only cover waits made
through it, not a plain ``dist.broadcast``. What does end a pending gloo
operation at once is an error on its connection. So each rank publishes the
local addresses of its TCP connections when the Join starts; once a rank is
judged lost, every other rank shuts down (``shutdown(2)``, not ``close``:
gloo still owns the descriptor) its connections to those addresses. The
pending operation fails with gloo's "Connection closed by peer", and
:class:`join_core.Join` turns that into :class:`RankLostError` naming the
lost rank. A rank still inside the Join shortly after a verdict (blocked on a
survivor that already left) has its connections to every rank shut down too.
Connections to the store are never touched. Finding the connections needs
``/proc/self/fd`` (Linux); elsewhere a frozen rank is still named, but only
once the waiting operation ends by itself.

The store is unauthenticated, so what is read from it is only compared
(heartbeats) or parsed into bounded lists of addresses, never unpickled; a
stranger who can write to it can at worst make a rank look lost or alive.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import threading
import time
from contextlib import suppress
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import torch.distributed as dist

from join_core.collective_watch import CollectiveWatch
from join_core.recorder import record_collectives

if TYPE_CHECKING:
    from collections.abc import Callable

    # The class get_group_store() returns; torch.distributed does not re-export it to type checkers.
    from torch._C._distributed_c10d import Store

__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT",
    "LivenessWatchdog",
    "RankLostError",
    "check_watch_timeouts",
    "spare_connections",
]

logger: logging.Logger = logging.getLogger(__name__)


#: The shortest liveness or hang timeout.
_MIN_TIMEOUT: Final = timedelta(milliseconds=100)


def check_watch_timeouts(
    owner: str, liveness_timeout: object, hang_timeout: object, liveness_off_allowed: bool = True
) -> None:
    """Refuse, naming ``owner``'s argument and the fix, a liveness or hang timeout that is not a
    positive ``timedelta`` (or None, where that turns it off)."""
    for name, value, off_allowed in (
        ("liveness_timeout", liveness_timeout, liveness_off_allowed),
        ("hang_timeout", hang_timeout, True),
    ):
        off = "; pass None to turn it off" if off_allowed else ""
        if value is None and off_allowed:
            continue
        if not isinstance(value, timedelta):
            raise TypeError(
                f"{owner}({name}={value!r}): must be a datetime.timedelta, e.g. timedelta(seconds=30){off}"
            )
        if value.total_seconds() <= 0:
            raise ValueError(f"{owner}({name}={value!r}): must be positive{off}")
        if value < _MIN_TIMEOUT:
            raise ValueError(
                f"{owner}({name}={value!r}): must be at least {_MIN_TIMEOUT.total_seconds():g} s (heartbeats go "
                f"every fifth of the liveness timeout through the store){off}"
            )


#: How long a rank may go without a heartbeat before the others call it lost.
DEFAULT_LIVENESS_TIMEOUT: Final = timedelta(seconds=5)
#: Heartbeats per timeout: a loss is told at most timeout * (1 + 1/this) after it.
BEATS_PER_TIMEOUT: Final = 5
#: After a verdict, how many heartbeat intervals the main thread gets to leave
#: the Join before this rank's connections to every rank are shut down.
ESCALATE_AFTER_BEATS: Final = 2
#: How long, in liveness timeouts, a failed collective may wait for a verdict
#: while some rank has not beaten since (a loaded host delays the watch).
VERDICT_WAIT_TIMEOUTS: Final = 3

_LEFT: Final = "left"
# Written instead by a rank that left its Join raising, without telling the others through
# the Join's own abort (which needs their collectives): they judge it as lost, with its reason.
_FAILED: Final = "failed"
_FAILURE_BYTES: Final = 400  # the reason a failed rank gives, as far as it is read
_STORE_HOST: Final = "store"  # in a rank's published endpoints: its process serves the store
_BEAT_BYTES: Final = 32  # a heartbeat is a short counter; longer values are cut
_MAX_ENDPOINTS_BYTES: Final = 64 * 1024
_MAX_ENDPOINTS: Final = 4096
_MAX_VERDICT_BYTES: Final = 64 * 1024
# How gloo tells that the process at the other end of a connection closed it.
_CLOSED_BY_PEER: Final = re.compile(
    r"(?:[Cc]onnection closed by peer|Read error|Write error) \[([0-9A-Fa-f:.%]+)\]:(\d+)"
    r"(?:\.|: Connection reset by peer|: Broken pipe)"
)

_Endpoint = tuple[str, int]

# torch's stubs do not re-export the store classes it documents publicly.
_PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]

# Local listening ports whose connections the watch never shuts down (an RPC
# agent's), each with how many holders spare it.
_spared_ports: dict[int, int] = {}
_spared_lock = threading.Lock()


def spare_connections(port: int) -> Callable[[], None]:
    """Keep the liveness watch's hands off the connections of the listener on
    local ``port``: after a loss it shuts down connections to stop the waits
    of the process group, and must not take an RPC agent's with them.

    For libraries with connections of their own between the ranks (an RPC
    agent calls it with its listening port). A connection is spared when
    either end's local port is spared on its own process, so each process
    spares its own listener.

    Returns:
        A function to call when the listener closes: the port is spared no
        more (the system may give it to a process group's connection next).
        Calling it again does nothing.
    """
    if not 0 < port < 65536:
        raise ValueError(f"spare_connections(port={port}): not a TCP port")
    with _spared_lock:
        _spared_ports[port] = _spared_ports.get(port, 0) + 1
    released = False

    def release() -> None:
        nonlocal released
        with _spared_lock:
            if released:
                return
            released = True
            if _spared_ports[port] == 1:
                del _spared_ports[port]
            else:
                _spared_ports[port] -= 1

    return release


_joins_lock = threading.Lock()
# group name -> Joins started on it by this process; every rank starts the
# same Joins in the same order, so the count names one Join on every rank.
_joins: dict[str, int] = {}


class RankLostError(RuntimeError):
    """Raised on every surviving rank of a Join (or of a
    :func:`~join_core.watch_collectives` watch) when a rank died, froze or was
    cut off: it stopped sending heartbeats for longer than the liveness timeout.

    The process group can no longer be used; destroy it and restart the job
    (torchrun restarts it with ``--max-restarts``), or let the survivors go on
    with ``Join(on_rank_lost="continue")``.

    Args:
        ranks: each lost rank, with what was seen.
        detail: what follows the lost ranks in the message (default: what to do).
        source: what the message starts with: who gave up (``"Join aborted"``).

    Attributes:
        ranks: each lost rank (in the Join's process group), with what was seen.
    """

    def __init__(
        self, ranks: dict[int, str], detail: str | None = None, *, source: str = "Join aborted"
    ) -> None:
        self.ranks = ranks
        super().__init__(
            f"{source}: lost {_describe(ranks)}; "
            + (
                detail
                if detail is not None
                else "the process group cannot complete a collective any more: destroy it and restart "
                "the job, or pass Join(on_rank_lost='continue') to go on without it"
            )
        )


_WATCH_DETAIL: Final = (
    "the process group cannot complete a collective any more: destroy it and restart the job (a training "
    "loop under Join(on_rank_lost='continue') goes on without it)"
)


def _describe(ranks: dict[int, str]) -> str:
    return "; ".join(f"rank {rank} ({seen})" for rank, seen in sorted(ranks.items()))


class LivenessWatchdog:
    """A thread that beats for this rank and watches the others' beats.

    Every ``timeout / BEATS_PER_TIMEOUT`` it writes a counter under its key in
    the group's store and reads the other ranks' counters. A rank whose counter
    has not moved for ``timeout`` is lost: the verdict is recorded and the
    connections to it are shut down (see the module's docstring). A rank not
    seen yet is not judged (ranks may reach a Join far apart); one that left
    its Join says so and is no longer watched.

    With ``hang_timeout``, each heartbeat also carries a summary of this
    rank's collectives on the group, so that a desync is raised and a hang
    reported (:mod:`join_core.collective_watch`).

    Args:
        group: the Join's process group.
        timeout: how long a rank may go without a heartbeat.
        hang_timeout: the least wait of a collective reported as a hang;
            None: no hang reports.
        collectives: False leaves collectives unwatched (no desync errors, no hang reports).
        prefix: the store prefix (default: one per Join on the group).
        until_main_thread_ends: stop when the main thread has ended
            (a watch not tied to a Join).
        judge_closed_connections: a collective on the group that fails
            because a rank's process closed its connection judges that rank
            lost at once (:meth:`judge_closed_connection`), not a timeout later.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        timeout: timedelta,
        hang_timeout: timedelta | None = None,
        *,
        collectives: bool = True,
        prefix: str | None = None,
        until_main_thread_ends: bool = False,
        judge_closed_connections: bool = False,
    ) -> None:
        if timeout.total_seconds() <= 0:
            raise ValueError(
                f"Join(liveness_timeout={timeout!r}): must be positive; pass None to turn liveness off"
            )
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._timeout = timeout
        self._interval = timeout.total_seconds() / BEATS_PER_TIMEOUT
        # Keys under a prefix of its own are deleted once every rank left (see _clear_if_last);
        # a prefix given (watch_collectives') may be the next watch's too.
        self._clears_keys = prefix is None
        if prefix is None:
            name = group.group_name
            with _joins_lock:
                index = _joins.get(name, 0)
                _joins[name] = index + 1
            prefix = f"join_core/liveness/{index}/"
        self._prefix = prefix
        self._until_main_thread_ends = until_main_thread_ends
        self._label = "watch_collectives" if until_main_thread_ends else "Join"  # who logs
        self._collectives = CollectiveWatch(group, hang_timeout, prefix) if collectives else None
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._verdict_ready = threading.Event()
        self._verdict: dict[int, str] = {}
        self._store_port: int | None = None
        self._store_lost = False  # set by the thread: then it writes nothing more
        self._hosts_store = False  # this process serves the store: it outlives the others' reading
        self._store_hosts: set[int] = set()  # other ranks whose process serves the store (the thread's)
        self._departed: set[int] = set()  # ranks that left their Join (set by the thread)
        self._leaving = _LEFT  # what this rank's heartbeat key says once it left (see stop())
        self._failure_note = ""
        self._beats_seen: dict[int, int] = {}  # rank -> how often its counter was seen moving (the thread's)
        self._moved: dict[int, float] = {}  # rank -> when its counter last moved (the thread's)
        self._endpoints: dict[int, set[_Endpoint]] = {}  # rank -> its published connections (the thread's)
        self._judge_lock = threading.Lock()  # one verdict, whichever thread reaches it
        self._main_store: Store | None = None  # the main thread's own client, made when first needed
        # Not a daemon: the interpreter waits for it at exit (a thread killed inside torch's store
        # client aborts the process), and stop() need not.
        self._thread = threading.Thread(target=self._run, name="join-liveness", daemon=False)
        self._judges_closed = judge_closed_connections

    def start(self) -> None:
        """Publish this rank's connections and first heartbeat, then beat and
        watch in the background.

        The first heartbeat is written before this returns, so that a rank
        that freezes right after entering its Join is watched all the same."""
        store = self._group.get_group_store()
        self._store_port = _store_port(store)
        endpoints, self._hosts_store = _own_endpoints(self._store_port)
        published = _encode(endpoints, self._hosts_store)
        # One round trip; endpoints first: a rank whose heartbeat is seen has published them.
        keys, values = [self._endpoints_key(self._rank), self._key(self._rank)], [published, "0"]
        if self._collectives is not None:
            # Before the heartbeat: a rank whose heartbeat is seen has its summary's key too.
            keys.insert(1, self._collectives.key(self._rank))
            values.insert(1, "{}")
        multi_set: Any = getattr(store, "multi_set", None)  # missing from torch's stubs, and from older torch
        if multi_set is not None:
            multi_set(keys, values)
        else:
            for key, value in zip(keys, values):
                store.set(key, value)
        if self._judges_closed:
            record_collectives().set_explainer(self._group.group_name, self.judge_closed_connection)
        self._thread.start()

    def stop(self, failure: str | None = None) -> None:
        """Stop, telling the other ranks this one left (not lost); or, with
        ``failure``, that it left its Join raising that (the others, maybe
        waiting on it in a collective, then judge it lost, naming it).

        Returns at once; the thread says so within a store round trip, and
        the interpreter waits for it at exit."""
        self._leaving = _LEFT if failure is None else _FAILED
        self._failure_note = failure or ""
        self._stop.set()
        if self._judges_closed:
            record_collectives().set_explainer(self._group.group_name, None)
        self._main_store = None  # released now: a store client destroyed at interpreter exit aborts it

    def lost(self) -> dict[int, str]:
        """The lost ranks seen so far, with what was seen (empty while all are alive)."""
        return dict(self._verdict) if self._verdict_ready.is_set() else {}

    def wait_for_verdict(self) -> dict[int, str]:
        """The lost ranks, waiting long enough for a rank that died just now
        to be judged: call it when a collective failed.

        Returns as soon as there is a verdict, or every watched rank was seen
        beating twice since the failure (once could be a beat written before
        it died), or the watch stopped; at most ``VERDICT_WAIT_TIMEOUTS``
        liveness timeouts."""
        self._await_verdict()
        return self.lost()

    @property
    def hosts_store(self) -> bool:
        """Whether this rank's process serves the group's store (known once started): as
        when a script is launched by hand with ``MASTER_ADDR`` and rank 0 hosts the TCPStore."""
        return self._hosts_store

    def lost_store_host(self) -> int | None:
        """The lost rank whose process served the group's store, if one is lost: the
        store is gone with it, and no rank can agree on anything through it any more."""
        return next((rank for rank in sorted(self.lost()) if rank in self._store_hosts), None)

    @property
    def prefix(self) -> str:
        """The store prefix of this watch's keys."""
        return self._prefix

    @property
    def interval(self) -> float:
        """Seconds between heartbeats."""
        return self._interval

    @property
    def rank(self) -> int:
        """This rank, in the watched group."""
        return self._rank

    def departed(self, rank: int) -> bool:
        """Whether ``rank`` left its Join (as this watch saw it)."""
        return rank in self._departed

    def quiet_for(self, rank: int) -> float | None:
        """Seconds since ``rank``'s heartbeat last moved (as this watch saw it), or
        None if it was never seen or left its Join. Goes on after a verdict."""
        if rank in self._departed:
            return None
        moved = self._moved.get(rank)
        return None if moved is None else time.monotonic() - moved

    def store(self) -> Store:
        """A store client of the calling thread's own, whose calls time out after the liveness timeout."""
        if self._main_store is None:
            self._main_store = _own_client(self._group.get_group_store(), self._timeout)
        return self._main_store

    def published_verdict(self) -> dict[int, str]:
        """The verdict published in the store by any rank, this one's own name
        included (a rank that was away reads it to learn that it was removed);
        {} if none or malformed."""
        store = self.store()
        if not store.check([self._verdict_key()]):
            return {}
        return self._adopt(store.get(self._verdict_key()), allow_self=True)

    def judge_closed_connection(self, failure: BaseException) -> None:
        """Judge at once the rank whose process closed the connection that made
        a collective fail (gloo's "Connection closed by peer"): it died.

        A connection shut down by a rank that adopted a verdict is told apart:
        that verdict was published before, and is adopted here. Nothing is
        judged when the connection is not one of a watched rank's, or that
        rank left its Join."""
        if self._verdict_ready.is_set():
            return
        match = _CLOSED_BY_PEER.search(str(failure))
        if match is None:
            return
        try:
            host, port = _normalize(match[1]), int(match[2])
            # gloo 2.13 prints the port in network byte order: either reading names the rank.
            named = {(host, port), (host, socket.ntohs(port) if port < 65536 else port)}
        except (ValueError, OverflowError):
            return
        # The process that served the store took it along: judged from what the thread read
        # before, as a new client of the store would wait for it until the group's timeout.
        known = dict(self._endpoints)
        for host_rank in set(self._store_hosts):
            if named & known.get(host_rank, set()):
                seen = f"its process ended: its connection closed ({match[0]}); it served the store"
                self._judge({host_rank: seen}, known[host_rank], self._store_port, None)
                return
        store = self.store()
        endpoints = self._published_endpoints(store)
        ranks = [rank for rank, ends in endpoints.items() if named & ends]
        if len(ranks) != 1:
            return
        rank = ranks[0]
        published = self._adopt(store.get(self._verdict_key())) if store.check([self._verdict_key()]) else {}
        if published:
            peers = set().union(*(endpoints.get(lost, set()) for lost in published))
            self._judge(published, peers, self._store_port, store)
        elif store.get(self._key(rank))[:_BEAT_BYTES] != _LEFT.encode():
            seen = f"its process ended: its connection closed ({match[0]})"
            self._judge({rank: seen}, endpoints[rank], self._store_port, store)

    def release_group(self) -> None:
        """Shut down this process's connections to every rank of the group
        (but the store's and spared ones), at once: the survivors still
        waiting on this rank in the group's collectives stop waiting. The
        group cannot be used any more."""
        endpoints = self._published_endpoints(self.store())
        _shut_down(set().union(*endpoints.values()), self._store_port)

    def _published_endpoints(self, store: Store) -> dict[int, set[_Endpoint]]:
        """The other ranks' published connections, read now (the thread may not have yet)."""
        found = {}
        for rank in range(self._world_size):
            if rank != self._rank and store.check([self._endpoints_key(rank)]):
                found[rank] = _decode(store.get(self._endpoints_key(rank)))[0]
        return found

    def failure(self) -> BaseException | None:
        """The verdict reached so far, as the error to raise; None while there is none."""
        return self._failure if self._verdict_ready.is_set() else None

    def wait_for_failure(self) -> BaseException | None:
        """What made a collective fail, as the error to raise: RankLostError or
        CollectiveDesyncError; None if no verdict came in time (see
        :meth:`wait_for_verdict`)."""
        self._await_verdict()
        return self._failure if self._verdict_ready.is_set() else None

    def _await_verdict(self) -> None:
        """Wait, after a failed collective, until there is a verdict, or every
        watched rank was seen beating twice since (once could be a beat written
        before it died), or the watch stopped; at most ``VERDICT_WAIT_TIMEOUTS``
        liveness timeouts."""
        before = dict(self._beats_seen)
        deadline = time.monotonic() + VERDICT_WAIT_TIMEOUTS * self._timeout.total_seconds()
        while not self._verdict_ready.wait(self._interval):
            seen = dict(self._beats_seen)
            alive = all(
                seen.get(rank, 0) >= before.get(rank, 0) + 2
                for rank in range(self._world_size)
                if rank != self._rank and rank not in self._departed
            )
            if alive or time.monotonic() > deadline or not self._thread.is_alive():
                break

    # The thread.

    def _run(self) -> None:
        # The first round after one beat: a Join shorter than that costs no client of our own
        # (connecting one holds the GIL for a moment the main thread would pay for).
        if self._stop.wait(self._interval):
            with suppress(Exception):  # nothing waits on this
                self._say_left(self._group.get_group_store())
                self._clear_if_last(self._group.get_group_store())
            return
        shared = self._group.get_group_store()
        for attempt in range(_OWN_CLIENT_ATTEMPTS):
            try:
                store = _own_client(shared, self._timeout)
                break
            except Exception as error:  # noqa: BLE001 - liveness is a safety net, not a requirement
                if attempt + 1 < _OWN_CLIENT_ATTEMPTS and not self._stop.wait(self._interval / 4):
                    continue
                # It still beats through the group's client (a rank that stops beating is judged
                # lost), queued behind the main thread's waits on that client, if any.
                logger.warning(
                    "%s: rank %d watches liveness through the group's store client (none of its own: %s)",
                    self._label,
                    self._rank,
                    error,
                )
                store = shared
        try:
            self._watch(store, self._store_port)
        except Exception as error:  # noqa: BLE001 - see above; the main thread must not be disturbed
            logger.warning("%s: rank %d stopped watching liveness: %s", self._label, self._rank, error)
        finally:
            if self._collectives is not None and not self._store_lost:
                with suppress(Exception):  # a report the others wait for: finish it
                    self._collectives.finish_report(store)
            if self._hosts_store and self._verdict_ready.is_set() and not self._store_lost:
                self._await_verdict_read(store)
            if not self._store_lost:
                with suppress(Exception):  # nothing waits on this
                    self._say_left(store)
                    self._clear_if_last(store)
            if self._collectives is not None:
                self._collectives.close()
            # Release our client here, on this thread, while the process is whole: torch's store
            # client destroyed during interpreter shutdown aborts the process.
            del store

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _failure_key(self, rank: int) -> str:
        return f"{self._prefix}failure/{rank}"

    def _say_left(self, store: Store) -> None:
        if self._leaving == _FAILED:  # the reason first: a rank seen failed has it
            store.set(self._failure_key(self._rank), self._failure_note[:_FAILURE_BYTES])
        store.set(self._key(self._rank), self._leaving)

    def _clear_if_last(self, store: Store) -> None:
        """The last rank to leave a Join that ended well deletes its keys: no
        watch reads them any more, and a job that runs a Join per epoch must
        not grow the store by each. After a loss or a failure they stay (the
        survivors' agreement and the dumps read them)."""
        if not self._clears_keys or self._leaving != _LEFT or self._verdict_ready.is_set():
            return
        if int(store.add(self._left_key(), 1)) < self._world_size:
            return
        for rank in range(self._world_size):
            store.delete_key(self._key(rank))
            store.delete_key(self._endpoints_key(rank))
            if self._collectives is not None:
                store.delete_key(self._collectives.key(rank))
        store.delete_key(self._left_key())

    def _left_key(self) -> str:
        return f"{self._prefix}left"

    def _endpoints_key(self, rank: int) -> str:
        return f"{self._prefix}endpoints/{rank}"

    def _verdict_key(self) -> str:
        return f"{self._prefix}verdict"

    def _read_key(self, rank: int) -> str:
        return f"{self._prefix}verdict-read/{rank}"

    def _await_verdict_read(self, store: Store) -> None:
        """Keep the store this process serves until every other survivor read the verdict (at
        most one liveness timeout): torn down first, it would look lost to them itself."""
        waiting = [
            self._read_key(rank)
            for rank in range(self._world_size)
            if rank != self._rank and rank not in self._verdict and rank not in self._departed
        ]
        if waiting:
            with suppress(Exception):  # a survivor that never reads it: its own verdict stands
                store.wait(waiting, self._timeout)

    def _adopt(self, raw: bytes, allow_self: bool = False) -> dict[int, str]:
        """The verdict another rank published (it reached one first), or {} if malformed
        (or, unless ``allow_self``, naming this rank)."""
        if len(raw) > _MAX_VERDICT_BYTES:
            return {}
        try:
            parsed = json.loads(raw)
            lost = {int(rank): str(seen)[:500] for rank, seen in parsed.items()}
        except (ValueError, TypeError, AttributeError, RecursionError):
            return {}
        if not lost or not all(
            0 <= rank < self._world_size and (allow_self or rank != self._rank) for rank in lost
        ):
            return {}
        return lost

    def _watch(self, store: Store, store_port: int | None) -> None:
        others = [rank for rank in range(self._world_size) if rank != self._rank]
        endpoints = self._endpoints
        store_hosts = self._store_hosts
        last: dict[int, bytes] = {}
        moved = self._moved  # rank -> when its counter last moved
        departed: set[int] = set()
        timeout_s = self._timeout.total_seconds()
        beat = 0
        last_round = time.monotonic()
        verdict_at: float | None = None
        escalated = False
        store_lost = False
        first = True  # the first round at once (one beat after the start)
        collectives = self._collectives
        main_thread = threading.main_thread()
        while first or not self._stop.wait(self._interval):
            first = False
            if self._until_main_thread_ends and not main_thread.is_alive():
                return
            now = time.monotonic()
            if verdict_at is None and self._verdict_ready.is_set():
                verdict_at = now  # reached on the main thread (judge_closed_connection)
            if (
                verdict_at is not None
                and not escalated
                and now - verdict_at > ESCALATE_AFTER_BEATS * self._interval
            ):
                # Still inside the Join: blocked on a survivor that already left it.
                escalated = True
                _shut_down(set().union(*endpoints.values()), store_port)
            if store_lost:
                continue  # nothing more to learn from it, and every call would fail again
            try:
                beat += 1
                if collectives is None:
                    store.set(self._key(self._rank), str(beat))
                else:
                    multi_set: Any = getattr(store, "multi_set")  # noqa: B009 - missing from torch's stubs
                    multi_set(
                        [self._key(self._rank), collectives.key(self._rank)],
                        [str(beat), collectives.summary()],
                    )
                for rank in others:
                    if rank not in endpoints and store.check([self._key(rank)]):
                        # Published before its first beat, so present now.
                        endpoints[rank], hosts = _decode(store.get(self._endpoints_key(rank)))
                        if hosts:
                            store_hosts.add(rank)
                        moved[rank] = now
                watched = [rank for rank in endpoints if rank not in departed]
                keys = [self._key(rank) for rank in watched]
                if collectives is not None:
                    keys += [collectives.key(rank) for rank in [*watched, self._rank]]
                values = store.multi_get(keys) if keys else []
                if collectives is not None and verdict_at is None:
                    summaries = dict(zip([*watched, self._rank], values[len(watched) :]))
                    desync = collectives.round(store, summaries)
                    if desync is not None:
                        verdict_at = now
                        with self._judge_lock:
                            if not self._verdict_ready.is_set():
                                self._fail(desync, set().union(*endpoints.values()), store_port, None)
                if verdict_at is None and store.check([self._verdict_key()]):
                    adopted = self._adopt(store.get(self._verdict_key()))
                    if adopted:  # one verdict for every rank: the first published
                        verdict_at = now
                        peers = set().union(*(endpoints.get(rank, set()) for rank in adopted))
                        self._judge(adopted, peers, store_port, store)
            except Exception as error:  # noqa: BLE001 - any store failure counts against the store
                # The call itself may have waited up to the timeout: judge from now.
                now = time.monotonic()
                if verdict_at is None and now - last_round > timeout_s:
                    verdict_at = now
                    quiet = now - last_round
                    if store_hosts:  # most likely the rank that served it is gone
                        lost = {
                            rank: f"its rendezvous store has not answered for {quiet:.1f} s: "
                            f"it died, froze or was cut off ({error})"
                            for rank in store_hosts
                        }
                        peers = set().union(*(endpoints[rank] for rank in store_hosts))
                    else:
                        lost = {
                            self._rank: f"this rank: cut off from the rendezvous store for {quiet:.1f} s "
                            f"(this rank's network or the store's host failed): {error}"
                        }
                        peers = set().union(*endpoints.values())
                    self._judge(lost, peers, store_port, None)
                    store_lost = self._store_lost = True
                continue
            if now - last_round > timeout_s / 2:
                # This thread itself was held up (a loaded host, a stopped
                # process resumed): nobody's silence can be judged from it.
                moved.update(dict.fromkeys(moved, now))
            last_round = now
            failed: dict[int, str] = {}
            for rank, value in zip(watched, values):
                value = value[:_BEAT_BYTES]
                if value == _LEFT.encode():
                    departed.add(rank)
                    self._departed.add(rank)
                elif value == _FAILED.encode():
                    try:
                        note = store.get(self._failure_key(rank))[:_FAILURE_BYTES].decode("utf-8", "replace")
                    except Exception:  # noqa: BLE001 - gone with its store: it failed all the same
                        note = "an error (its reason could not be read)"
                    failed[rank] = f"it left the Join raising {note}"
                elif value != last.get(rank):
                    last[rank] = value
                    moved[rank] = now
                    self._beats_seen[rank] = self._beats_seen.get(rank, 0) + 1
            if verdict_at is not None:
                continue
            silent = {
                rank: now - moved[rank] for rank in watched if rank not in departed and rank not in failed
            }
            lost = {
                rank: f"no heartbeat for {quiet:.1f} s: it died, froze or was cut off"
                for rank, quiet in silent.items()
                if quiet > timeout_s
            }
            lost.update(failed)
            if lost:
                verdict_at = now
                self._judge(lost, set().union(*(endpoints[rank] for rank in lost)), store_port, store)

    def _judge(
        self, lost: dict[int, str], peers: set[_Endpoint], store_port: int | None, store: Store | None
    ) -> None:
        with self._judge_lock:
            if not self._verdict_ready.is_set():
                self._judge_first(lost, peers, store_port, store)

    def _judge_first(
        self, lost: dict[int, str], peers: set[_Endpoint], store_port: int | None, store: Store | None
    ) -> None:
        if store is not None:
            # Published for the others; if one was published first, that one is every rank's verdict.
            with suppress(Exception):
                encoded = json.dumps({str(rank): seen for rank, seen in lost.items()})
                first = self._adopt(store.compare_set(self._verdict_key(), "", encoded))
                if first and first != lost:
                    lost = first
                store.set(self._read_key(self._rank), "1")
        self._verdict = lost
        error = (
            RankLostError(lost, _WATCH_DETAIL, source="watch_collectives")
            if self._until_main_thread_ends
            else RankLostError(lost)
        )
        record_collectives().set_verdict(self._group.group_name, error, self._group)
        self._fail(error, peers, store_port, store)

    def _fail(
        self, error: BaseException, peers: set[_Endpoint], store_port: int | None, store: Store | None
    ) -> None:
        """Record the verdict, unblock the waiting collectives, and dump (a
        lost rank; a desync's watch dumps on its own)."""
        self._failure = error
        self._verdict_ready.set()
        label = self._label
        if self._judges_closed and isinstance(error, RankLostError):  # the survivors go on
            logger.warning("%s: rank %d: lost %s", label, self._rank, _describe(error.ranks))
        else:
            logger.error("%s: rank %d: %s", label, self._rank, error)
        _shut_down(peers, store_port)
        if isinstance(error, RankLostError) and self._collectives is not None:
            self._collectives.write_dump(store, "lost", str(error))


#: Tries at a store client of the watch's own (a store host busy with many ranks connecting
#: at once can refuse one) before the watch uses the group's.
_OWN_CLIENT_ATTEMPTS: Final = 3


def _own_client(store: Store, timeout: timedelta) -> Store:
    """A connection of our own to the store, so that its timeout bounds only
    our calls (a lost store must be noticed within the liveness timeout)."""
    clone = getattr(store, "clone", None)  # torch's stubs lack Store.clone
    if clone is None:
        return store
    own: Store = clone()
    own.set_timeout(timeout)
    return own


def _store_port(store: Store) -> int | None:
    while isinstance(store, _PrefixStore):
        store = store.underlying_store
    return store.port if isinstance(store, _TCPStore) else None


def _normalize(host: str) -> str:
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def _tcp_sockets() -> list[socket.socket]:
    """Duplicates of this process's TCP sockets (Linux; empty elsewhere).
    Shutting a duplicate down shuts the connection down for its owner too."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    found = []
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            duplicate = os.dup(int(name))
        except (OSError, ValueError):
            continue  # closed meanwhile
        try:
            sock = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)  # the number went to something else than a socket meanwhile
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            found.append(sock)
        else:
            sock.close()
    return found


def _connections(store_port: int | None) -> list[tuple[socket.socket, _Endpoint, _Endpoint]]:
    """This process's connected TCP sockets with (local, peer) endpoints,
    leaving out those to or from the store."""
    found = []
    for sock in _tcp_sockets():
        try:
            local, peer = sock.getsockname(), sock.getpeername()
            ends = (_normalize(local[0]), int(local[1])), (_normalize(peer[0]), int(peer[1]))
        except (OSError, ValueError):
            sock.close()  # a listener, or gone
            continue
        if (store_port is not None and store_port in (ends[0][1], ends[1][1])) or ends[0][1] in _spared_ports:
            sock.close()
            continue
        found.append((sock, *ends))
    return found


def _own_endpoints(store_port: int | None) -> tuple[list[_Endpoint], bool]:
    """The local ends of this process's connections and listeners (but the
    store's), and whether this process serves the store (has a listener on its
    port). A listener's address names this process in a peer's error when a
    connection it accepted closes."""
    endpoints, hosts_store = [], False
    for sock in _tcp_sockets():
        try:
            local = sock.getsockname()
            if local[1] in _spared_ports:
                continue  # an RPC agent's listener or connection: never shut down
            try:
                peer = sock.getpeername()
            except OSError:
                if store_port is not None and local[1] == store_port:
                    hosts_store = True
                else:
                    endpoints.append((_normalize(local[0]), int(local[1])))
                continue  # a listener
            if store_port is not None and store_port in (local[1], peer[1]):
                continue
            endpoints.append((_normalize(local[0]), int(local[1])))
        except (OSError, ValueError):
            continue  # gone meanwhile
        finally:
            sock.close()
    return endpoints, hosts_store


def _shut_down(peers: set[_Endpoint], store_port: int | None) -> None:
    count = 0
    for sock, _, peer in _connections(store_port):
        try:
            if peer in peers:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass  # already closed by its owner
        finally:
            sock.close()
    logger.info("Join: shut down %d connection(s) to lost or departed ranks", count)


def _encode(endpoints: list[_Endpoint], hosts_store: bool) -> str:
    items = [f"{host},{port}" for host, port in endpoints[:_MAX_ENDPOINTS]]
    return ";".join([_STORE_HOST, *items] if hosts_store else items)


def _decode(raw: bytes) -> tuple[set[_Endpoint], bool]:
    """Parse another rank's published endpoints, and whether it serves the
    store, skipping anything malformed."""
    found: set[_Endpoint] = set()
    if len(raw) > _MAX_ENDPOINTS_BYTES:
        return found, False
    items = raw.decode("ascii", "replace").split(";")[: _MAX_ENDPOINTS + 1]
    for item in items:
        host, _, port = item.partition(",")
        try:
            number = int(port)
            if 0 < number < 65536:
                found.add((_normalize(host), number))
        except ValueError:
            continue
    return found, _STORE_HOST in items
