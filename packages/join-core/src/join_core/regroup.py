"""After a loss, the surviving ranks of a Join agree on who goes on, and
where each of them was, through the rendezvous store; then they build their
own process group.

The agreement is one record in the store, written once (``compare_set``) by
the first survivor that sees every other survivor arrive, or every missing
one fall silent too (a second loss during the agreement): every survivor
adopts that record, so all of them build the same group and know the same
positions. A rank not in the record was declared lost: it is fenced
(:class:`RankRemovedError`) and never joins the new group.

What is read from the store is parsed into bounded lists of integers, never
unpickled: a stranger who can write to it can at worst make a rank look lost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Final

import torch.distributed as dist

from join_core.liveness import RankLostError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["REGROUP_WAIT", "Recovery", "RankRemovedError"]

#: How long survivors wait for a survivor that is alive (it still beats) but
#: has not reached the agreement (it is in a long computation, or stuck).
REGROUP_WAIT: Final = timedelta(minutes=5)
_MAX_RECORD_BYTES: Final = 1 << 20


class RankRemovedError(RankLostError):
    """Raised on a rank that the others declared lost (it froze or was cut
    off) when it comes back: the survivors went on without it from
    :attr:`iteration`, and it must not touch their state again. Exit.

    Attributes:
        rank: this rank (global).
        iteration: the survivors' iteration when they removed it.
    """

    def __init__(self, rank: int, iteration: int | None, seen: str) -> None:
        self.rank = rank
        self.iteration = iteration
        at = f"at iteration {iteration}" if iteration is not None else "while this rank was away"
        super().__init__(
            {rank: seen},
            detail=f"this rank was removed {at}: the surviving ranks went on without it; "
            "it must not rejoin them: exit (a restarted job can take it back)",
        )


@dataclass(frozen=True)
class Recovery:
    """What the survivors of a loss agreed on, as :meth:`join_core.Join.recover` returns it.

    Attributes:
        group: the survivors' process group; every later collective of the Join is issued on it.
        rank: this rank's rank in ``group``.
        members: the global rank of each rank of ``group``, in group order.
        positions: by rank in ``group``: the stage of collectives each survivor
            failed in, counted over the Join's iterations: ``iteration * period + phase``.
        period: the stages of one iteration, over all the Join's joinables
            (each hook's ``regroup_phases``, in joinable order).
        iteration: the survivors' iteration then (Join's count, from 1).
        lost: every rank lost in this Join so far (global rank -> what was seen).
    """

    group: dist.ProcessGroup
    rank: int
    members: tuple[int, ...]
    positions: tuple[int, ...]
    period: int
    iteration: int
    lost: Mapping[int, str]

    def completed(self, position: int, phase: int) -> int:
        """How many times a survivor at ``position`` had finished stage ``phase``
        (of ``range(period)``) when it failed."""
        iteration, current = divmod(position, self.period)
        return iteration + (1 if current > phase else 0)

    def position(self, iteration: int, phase: int) -> int:
        """The position of stage ``phase`` of ``iteration``."""
        return iteration * self.period + phase


@dataclass(frozen=True)
class _Agreement:
    members: tuple[int, ...]
    positions: tuple[int, ...]
    iterations: tuple[int, ...]
    heartbeats: tuple[int, ...]


def agree(
    store: Store,
    prefix: str,
    me: int,
    expected: list[int],
    position: int,
    iteration: int,
    heartbeats: int,
    quiet_for: Callable[[int], float | None],
    silent_after: timedelta,
    poll: float,
    wait: timedelta = REGROUP_WAIT,
    departed: Callable[[int], bool] = lambda rank: False,
) -> _Agreement:
    """This rank's part in the agreement among ``expected`` (global ranks, this one included).

    Returns the adopted record. A survivor that has not arrived is left out
    only once its heartbeat has been silent for ``silent_after`` too.

    Raises:
        RankRemovedError: the record leaves this rank out.
        TimeoutError: a survivor still alive did not arrive within ``wait``, or
            one that has not arrived left its Join (``departed``): it will not.
    """
    record_key = f"{prefix}record"
    store.set(f"{prefix}at/{me}", f"{position} {iteration} {heartbeats}")
    deadline = time.monotonic() + wait.total_seconds()
    while not store.check([record_key]):
        arrived = [rank for rank in expected if store.check([f"{prefix}at/{rank}"])]
        missing = [rank for rank in expected if rank not in arrived]
        gone = [rank for rank in missing if departed(rank)]
        if gone:
            reason = (
                f"rank(s) {gone} left their Join before the survivors' agreement and will not reach it: "
                "the survivors cannot go on without them"
            )
            store.compare_set(record_key, "", json.dumps({"failed": reason}))
            break
        silent = [rank for rank in missing if (quiet_for(rank) or 0.0) > silent_after.total_seconds()]
        if len(silent) == len(missing):
            places = [_parse_place(store.get(f"{prefix}at/{rank}")) for rank in arrived]
            proposal = json.dumps(
                {
                    "members": arrived,
                    "positions": [place[0] for place in places],
                    "iterations": [place[1] for place in places],
                    "heartbeats": [place[2] for place in places],
                }
            )
            store.compare_set(record_key, "", proposal)
            break
        if time.monotonic() > deadline:
            # The agreement fails for every survivor, as one record: a survivor arriving later
            # must not take this rank (which leaves) for a member of the new group.
            reason = (
                f"rank(s) {missing} still beat but did not reach the survivors' agreement within "
                f"{wait.total_seconds():.0f} s (stuck outside a collective?)"
            )
            store.compare_set(record_key, "", json.dumps({"failed": reason}))
            break
        time.sleep(poll)
    agreement = _parse_record(store.get(record_key), expected)
    if me not in agreement.members:
        raise RankRemovedError(me, max(agreement.iterations, default=None), "left out of the survivors")
    return agreement


def removed_at(store: Store, prefix: str) -> int | None:
    """The iteration recorded by the survivors' agreement under ``prefix``, if one was reached."""
    key = f"{prefix}record"
    if not store.check([key]):
        return None
    try:
        return max(_parse_record(store.get(key), None).iterations, default=None)
    except (ValueError, TimeoutError):  # malformed, or the agreement failed
        return None


def build_group(members: tuple[int, ...], like: dist.ProcessGroup) -> dist.ProcessGroup:
    """The process group of ``members`` (global ranks), on the backend of ``like``.

    Only the members take part (``use_local_synchronization``): the lost
    ranks never could."""
    group = dist.new_group(
        ranks=list(members), backend=dist.get_backend(like), use_local_synchronization=True
    )
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"Join: could not build the survivors' process group over ranks {list(members)}")
    return group


def _parse_place(raw: bytes) -> tuple[int, int, int]:
    try:
        position, iteration, heartbeats = (
            int(part) for part in raw[:96].decode("ascii", "replace").split(" ")
        )
    except ValueError:
        return -1, -1, -1
    return position, iteration, heartbeats


def _parse_record(raw: bytes, expected: list[int] | None) -> _Agreement:
    """The agreement record, checked: bounded, integers only, members among ``expected``.

    Raises:
        TimeoutError: the record says the agreement failed (a survivor gave up waiting).
    """
    if len(raw) > _MAX_RECORD_BYTES:
        raise ValueError("Join: the survivors' agreement record in the store is too large")
    try:
        parsed = json.loads(raw)
        if isinstance(parsed, dict) and "failed" in parsed:
            raise TimeoutError(f"Join(on_rank_lost='continue'): {str(parsed['failed'])[:300]}")
        members = tuple(int(rank) for rank in parsed["members"])
        positions = tuple(int(value) for value in parsed["positions"])
        iterations = tuple(int(value) for value in parsed["iterations"])
        heartbeats = tuple(int(value) for value in parsed["heartbeats"])
    except (ValueError, TypeError, KeyError, RecursionError) as error:
        raise ValueError(
            f"Join: the survivors' agreement record in the store is malformed: {error}"
        ) from None
    if len({len(members), len(positions), len(iterations), len(heartbeats), len(set(members))}) != 1:
        raise ValueError("Join: the survivors' agreement record in the store is malformed")
    if expected is not None and not set(members) <= set(expected):
        raise ValueError(f"Join: the survivors' agreement names ranks {list(members)} beyond {expected}")
    return _Agreement(members, positions, iterations, heartbeats)
