"""The watch: a thread that moves work on from threads busy on one job for too long.

A connection's reader thread processes each frame it reads, and a strand's
runner runs each request of its peer in turn (:mod:`tensorpipe_backend.reader`,
:mod:`tensorpipe_backend.strands`); a called function may block there for
as long as it likes. Each of those threads numbers the job it starts
(:meth:`Watch.job`). Every tick (5 ms) the watch asks each room that it
watches what its threads are busy with; a thread still on the same job after
``STUCK_TICKS`` whole ticks is relieved: its room gives the rest of its work
(the socket, the strand) to a new thread, and the busy one ends when its job
is done. Idle for a second, the watch sleeps until a job starts.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Final, Protocol

__all__ = ["STUCK_TICKS", "Room", "Watch"]

_TICK: Final = 0.005
_IDLE_TICKS: Final = 200
STUCK_TICKS: Final = 4
"""A thread busy on one job this many ticks in a row (20 ms) is relieved."""
# One tick was too eager on a loaded host: readers waiting for the GIL or a core were taken for stuck,
# and each hand-off made a thread that contended too (8 trainers of a parameter server: 0.74x torch
# with 1 tick, 1.15x with 4).


class Room(Protocol):
    """Work that threads hold one at a time, and hand on when relieved."""

    def busy(self) -> Sequence[tuple[Hashable, int, object]]:
        """For each holder whose thread is on a job now: the holder, the job's number (from
        :meth:`Watch.job`) and the token of the thread that holds it."""
        ...

    def relieve(self, holder: Hashable, token: object) -> None:
        """Give the rest of ``holder``'s work to a new thread if ``token``'s thread still holds it."""
        ...


class Watch:
    """The watch of one agent: :meth:`run` is its thread; :meth:`add` the rooms it watches.

    A thread that starts a job marks its holder busy with :meth:`job`'s
    number, then calls :meth:`wake` if :attr:`sleeping` (in that order: the
    watch checks for busy holders again after it sets ``sleeping``).
    """

    def __init__(self) -> None:
        self._rooms: list[Room] = []
        self._jobs = itertools.count(1)
        self._wake = threading.Event()
        self._closed = False
        self.sleeping: bool = False
        """Whether the watch sleeps until :meth:`wake` (no job for a second)."""

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

    def add(self, room: Room) -> None:
        """Watch ``room`` too (before :meth:`run` starts)."""
        self._rooms.append(room)

    def job(self) -> int:
        """A number for a job that starts now (never 0)."""
        return next(self._jobs)

    def wake(self) -> None:
        """Wake the watch: a holder is busy now."""
        self.sleeping = False
        self._wake.set()

    def close(self) -> None:
        """Stop the watch thread."""
        self._closed = True
        self._wake.set()

    def run(self) -> None:
        """Every tick, relieve each holder that was on one job for ``STUCK_TICKS`` whole ticks."""
        quiet = 0
        ticks: dict[Hashable, tuple[int, int]] = {}  # per busy holder: its job, and ticks seen on it
        while not self._closed:
            time.sleep(_TICK)
            last, ticks = ticks, {}  # holders no longer busy drop out
            stuck: list[tuple[Room, Hashable, object]] = []
            for room in self._rooms:
                for holder, job, token in room.busy():
                    seen, count = last.get(holder, (0, 0))
                    count = count + 1 if seen == job else 0
                    ticks[holder] = (job, count)
                    if count >= STUCK_TICKS:
                        stuck.append((room, holder, token))
            for room, holder, token in stuck:
                room.relieve(holder, token)
            if ticks:
                quiet = 0
                continue
            quiet += 1
            if quiet < _IDLE_TICKS:
                continue
            # Idle: sleep until a job starts (its thread wakes the watch when it sees the flag).
            self._wake.clear()
            self.sleeping = True
            # close() sets _closed before the event, and a job is marked before its thread reads
            # the flag: both checked after clear(), so no wake-up is lost.
            if not self.closed and not any(room.busy() for room in self._rooms):
                self._wake.wait()
            self.sleeping = False
            quiet = 0
