"""Strands: the requests of one peer that wait their turn, and the thread that runs them in order.

Requests of one peer start in the order the peer sent them. While none of a
peer's requests waits, the caller of :meth:`Strands.enqueue` (the reader
thread) runs each itself. A request that arrives before the strands are
open (this worker's handler is not set yet), or while earlier ones of its
peer still wait, joins the peer's strand instead: one worker-pool thread at
a time, its runner, takes the strand's requests in order and runs them.

A runner whose request calls out (sends a call of its own, and will likely
wait for the reply: :func:`call_out`), or that the watch finds busy on one
request for too long (:mod:`tensorpipe_backend.watch`), hands the strand to
another pool thread and ends when that request is done, as a reader hands
its socket on (:mod:`tensorpipe_backend.reader`). What the request waits for
may be a later request of the same peer: in a distributed backward pass the
worker that waits for the pass is sent gradients back as requests. From
then on that request and the later ones of its peer run side by side; each
still starts after the ones its peer sent before it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Generic, TypeVar

from .watch import Watch

__all__ = ["Strand", "Strands", "call_out", "running"]

T = TypeVar("T")

_BATCH: Final = 32
"""A runner that ran this many requests in a row goes to the back of the pool's queue."""

running: threading.local = threading.local()
"""``running.strand``: the hand-off of the strand whose request this thread runs (see :func:`call_out`)."""


class Strand(Generic[T]):
    """The waiting requests of one peer, the token of the thread that runs them (``None``: none),
    and the job number of the request it runs (``0``: none, see :mod:`.watch`)."""

    __slots__ = ("busy", "queue", "runner")

    def __init__(self) -> None:
        self.queue: collections.deque[T] = collections.deque()
        self.runner: object | None = None
        self.busy: int = 0


class _Running(Generic[T]):
    """What :func:`call_out` needs to hand on the strand of the request a runner runs."""

    __slots__ = ("strand", "strands", "token")

    def __init__(self, strands: Strands[T], strand: Strand[T], token: object) -> None:
        self.strands = strands
        self.strand = strand
        self.token = token


class Strands(Generic[T]):
    """The strands of one agent's peers, by peer name; a room of ``watch`` (see :mod:`.watch`).

    ``lock`` is the agent's; ``run`` runs one request (it must not raise);
    ``pool`` runs the runners.
    """

    def __init__(
        self, lock: threading.RLock, run: Callable[[T], None], pool: ThreadPoolExecutor, watch: Watch
    ) -> None:
        self._lock = lock
        self._run = run
        self._pool = pool
        self._watch = watch
        self._strands: dict[str, Strand[T]] = {}
        self._open = False

    def open(self) -> None:
        """Start running requests: the queued ones on runners, the later ones as they come."""
        with self._lock:
            self._open = True
            ready = []
            for strand in self._strands.values():
                if strand.queue and strand.runner is None:
                    strand.runner = token = object()
                    ready.append((strand, token))
        for strand, token in ready:
            self._launch(strand, token)

    def enqueue(self, peer: str, request: T) -> bool:
        """Whether the caller may run ``request`` of ``peer`` now, itself: the strands are open
        and none of ``peer``'s requests waits or runs on its strand. Otherwise ``request`` joins
        that strand, which gets a runner if it has none."""
        with self._lock:
            strand = self._strands.get(peer)
            if strand is None:
                strand = self._strands[peer] = Strand()
            if strand.runner is None and self._open and not strand.queue:
                return True
            strand.queue.append(request)
            if strand.runner is not None or not self._open:
                return False
            strand.runner = token = object()
        self._launch(strand, token)
        return False

    def hand_off(self, strand: Strand[T], token: object) -> None:
        """Give ``strand``'s later requests another runner, if ``token`` is its runner (which
        runs a request that calls out or takes long); it ends when that request is done."""
        with self._lock:
            if strand.runner is not token:
                return
            strand.busy = 0
            if not strand.queue:
                strand.runner = None  # the next request runs at once, in its reader thread
                return
            strand.runner = new = object()
        try:
            self._pool.submit(self._drain, strand, new)
        except RuntimeError:  # the pool is shut down: the current runner carries on afterwards
            with self._lock:
                if strand.runner is new:
                    strand.runner = token

    def busy(self) -> list[tuple[Hashable, int, object]]:
        """Each strand whose runner runs a request now: the strand, the request's job number and
        the runner's token (see :class:`.watch.Room`)."""
        with self._lock:
            return [(s, s.busy, s.runner) for s in self._strands.values() if s.busy]

    def relieve(self, holder: Hashable, token: object) -> None:
        """:meth:`hand_off` for the watch."""
        assert isinstance(holder, Strand)
        self.hand_off(holder, token)

    def _launch(self, strand: Strand[T], token: object) -> None:
        try:
            self._pool.submit(self._drain, strand, token)
        except RuntimeError:  # the pool is shut down: run them here
            self._drain(strand, token)

    def _drain(self, strand: Strand[T], token: object) -> None:
        """Run ``strand``'s requests in order while ``token`` is its runner."""
        outer = getattr(running, "strand", None)
        watch = self._watch
        try:
            for _ in range(_BATCH):
                with self._lock:
                    if strand.runner is not token:
                        return  # handed on
                    if not strand.queue:
                        strand.runner = None
                        strand.busy = 0
                        return
                    request = strand.queue.popleft()
                    strand.busy = watch.job()
                if watch.sleeping:
                    watch.wake()
                running.strand = _Running(self, strand, token)
                self._run(request)
        finally:
            running.strand = outer
        with self._lock:
            if strand.runner is not token:
                return
            strand.busy = 0  # not busy while it waits for a worker
        # Let other peers' requests have a worker before continuing with this one.
        self._launch(strand, token)


def call_out() -> None:
    """This thread sends a call of its own: if it runs a strand's request, the strand's later
    requests get another runner (that call may wait for one of them)."""
    held: _Running[object] | None = getattr(running, "strand", None)
    if held is not None:
        running.strand = None
        held.strands.hand_off(held.strand, held.token)
