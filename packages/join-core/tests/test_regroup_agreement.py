"""The survivors' agreement in the store: one record, adopted by every
survivor; a rank left out is fenced; what a stranger writes there is checked,
never trusted."""

from __future__ import annotations

import json
import pickle
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from join_core import RankLostError, RankRemovedError
from join_core.join import _SurvivorsSilent
from join_core.regroup import agree

HashStore: Any = dist.HashStore  # type: ignore[attr-defined]
SILENT_AFTER = timedelta(seconds=1)


def _agree(store: Any, me: int, expected: list[int], quiet: dict[int, float]) -> Any:
    return agree(store, "p/", me, expected, 7, 3, 2, quiet.get, SILENT_AFTER, 0.001, timedelta(seconds=2))


def test_the_first_survivor_to_see_every_other_arrive_writes_the_record_all_adopt() -> None:
    store = HashStore()
    store.set("p/at/1", "9 4 3")  # rank 1 arrived first: position 9, iteration 4, 3 heartbeats
    agreement = _agree(store, 0, [0, 1], {})
    assert agreement.members == (0, 1)
    assert agreement.positions == (7, 9)
    assert agreement.iterations == (3, 4)
    assert agreement.heartbeats == (2, 3)
    assert _agree(store, 1, [0, 1], {}) == agreement  # rank 1 adopts the same record


def test_a_survivor_that_fell_silent_during_the_agreement_is_left_out() -> None:
    store = HashStore()
    agreement = _agree(store, 0, [0, 2], {2: 5.0})  # rank 2 never arrives and beats no more
    assert agreement.members == (0,)


def test_a_survivor_still_beating_is_waited_for_then_named() -> None:
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\] still beat but did not reach"):
        _agree(HashStore(), 0, [0, 2], {2: 0.1})


def test_a_survivor_that_left_its_join_fails_the_agreement_at_once() -> None:
    # Its heartbeat had stopped with its Join (not silent, not lost): it was waited for, for the
    # whole wait, and named as still beating.
    store, quiet, left = HashStore(), dict[int, float](), {2}
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) \[2\] left their Join before the survivors' agreement"
    ):
        agree(
            store,
            "p/",
            0,
            [0, 2],
            7,
            3,
            2,
            quiet.get,
            SILENT_AFTER,
            0.001,
            timedelta(hours=1),
            left.__contains__,
        )
    with pytest.raises(TimeoutError, match=r"left their Join"):  # the others read the same record
        _agree(store, 1, [0, 1, 2], {})


def test_a_survivor_arriving_after_another_gave_up_fails_too_instead_of_counting_it_in() -> None:
    # Rank 0 waited in vain for rank 2 and leaves; its arrival stays in the store. Rank 2, late,
    # made a record with rank 0 in it, and then waited for it to build the new group.
    store = HashStore()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\] still beat"):
        _agree(store, 0, [0, 2], {2: 0.1})
    with pytest.raises(TimeoutError, match=r"the survivors' agreement within 2 s"):
        _agree(store, 2, [0, 2], {})


def test_a_rank_the_record_leaves_out_is_fenced() -> None:
    store = HashStore()
    store.set(
        "p/record", json.dumps({"members": [1], "positions": [4], "iterations": [6], "heartbeats": [5]})
    )
    with pytest.raises(RankRemovedError) as removed:
        _agree(store, 0, [0, 1], {})
    assert isinstance(removed.value, RankLostError)
    assert removed.value.iteration == 6
    assert "this rank was removed at iteration 6" in str(removed.value)


@pytest.mark.parametrize(
    "record",
    [
        b"{not json",
        json.dumps(
            {"members": [0, 1], "positions": [1], "iterations": [1, 1], "heartbeats": [1, 1]}
        ).encode(),
        json.dumps(
            {"members": [0, 5], "positions": [1, 1], "iterations": [1, 1], "heartbeats": [1, 1]}
        ).encode(),
        json.dumps(
            {"members": [0, 0], "positions": [1, 1], "iterations": [1, 1], "heartbeats": [1, 1]}
        ).encode(),
        json.dumps(
            {"members": ["__import__('os')"], "positions": [1], "iterations": [1], "heartbeats": [1]}
        ).encode(),
        b"[" * 2_000_000,
    ],
    ids=["not-json", "lengths-differ", "a-stranger", "twice", "not-a-number", "too-large"],
)
def test_a_malformed_record_is_refused(record: bytes) -> None:
    store = HashStore()
    store.set("p/record", record)
    with pytest.raises(ValueError, match="agreement"):
        _agree(store, 0, [0, 1], {})


def test_a_build_failure_read_from_the_store_names_only_members_and_is_cut_short() -> None:
    written = _SurvivorsSilent([1, 3], "rank(s) [1, 3] fell silent")
    read = _SurvivorsSilent.read(written.encode().encode(), (0, 1, 2, 3))
    assert (read.members, str(read)) == ([1, 3], "rank(s) [1, 3] fell silent")
    # Anyone can write to the store: ranks outside the group, garbage and a long text are dropped.
    forged = _SurvivorsSilent.read(b"1,x,99,-2,,\xff\n" + b"y" * 10_000, (0, 1, 2))
    assert (forged.members, len(str(forged))) == ([1], 300)
    assert _SurvivorsSilent.read(b"9" * 100_000, (0, 1)).members == []
    assert _SurvivorsSilent.read(b"0" * 4000 + b"1\nwhy", (0, 1)).members == []  # no 4000-digit int
    # It travels as the cause of the RankLostError (e.g. from a rank to the process that ran it).
    written.lost[2] = "its heartbeat stopped while the survivors agreed on who goes on"
    copied = pickle.loads(pickle.dumps(written))
    assert (copied.members, copied.lost, str(copied)) == (written.members, written.lost, str(written))
