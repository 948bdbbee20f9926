"""Hangs and desyncs named in seconds, on the liveness heartbeat.

Every heartbeat (:mod:`join_core.liveness`) each rank also publishes a short
summary of its collectives on the watched group: its latest records and its
pending ones (sequence number, op, fingerprint of shapes and dtypes, call
site), and whether one of them has waited longer than its threshold. Every
rank reads every other's, so, with no collective of ours:

- **desync**: two ranks whose records hold the same sequence number with
  different fingerprints entered different collectives. Every rank reaches
  the same verdict within a heartbeat or two: :class:`CollectiveDesyncError`
  naming both calls and their call sites, raised by the next collective on
  the group or by the one waiting (its connections are shut down, as for a
  lost rank).
- **hang**: a collective waiting longer than the larger of ``hang_timeout``
  and 20 times its median time makes every rank write its state, with the
  Python stacks of all its threads, under one key of the store; each rank
  reads all of them and logs the report (:func:`join_core.hang_report.analyze_hang`),
  whose first line names the culprit. Nothing is aborted: a slow rank may
  still come.

Each verdict and report also writes this rank's dump (:mod:`join_core.dump`).
What is read from the store is parsed as bounded JSON, never unpickled.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import torch.distributed as dist

from join_core import dump
from join_core.hang_report import analyze_hang, find_desync, rank_state, records_of
from join_core.recorder import CollectiveRecord, record_collectives, watching

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["DEFAULT_HANG_TIMEOUT", "CollectiveDesyncError", "CollectiveWatch"]

logger: logging.Logger = logging.getLogger(__name__)

#: The least time a collective waits before the hang report.
DEFAULT_HANG_TIMEOUT: Final = timedelta(seconds=30)
#: A collective waiting this many times its median time (if longer than the timeout) is reported.
MEDIAN_FACTOR: Final = 20
#: How long a report waits for the other ranks' states.
REPORT_WAIT_S: Final = 3.0
_SUMMARY_RECORDS: Final = 3
_MAX_SUMMARY_BYTES: Final = 16 * 1024
_MAX_STATE_BYTES: Final = 512 * 1024


class CollectiveDesyncError(dist.DistError):
    """The ranks entered different collectives at the same sequence number of
    a process group (another op, other shapes or dtypes): raised on every rank,
    naming each side's call and call site. The process group cannot be used
    any more."""


class CollectiveWatch:
    """The collective side of a liveness watchdog on one group: builds this
    rank's heartbeat summary and judges the others' (see the module docstring).

    Args:
        group: the watched process group.
        hang_timeout: the least wait reported as a hang; None: no hang reports.
        prefix: the store prefix of this watch (the liveness watchdog's).
    """

    def __init__(self, group: dist.ProcessGroup, hang_timeout: timedelta | None, prefix: str) -> None:
        self._recorder = record_collectives()
        self._group = group.group_name
        self._process_group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._hang_timeout = hang_timeout.total_seconds() if hang_timeout is not None else None
        self._prefix = prefix
        self._reported: set[int] = set()  # sequence numbers already reported
        self._report: tuple[Mapping[str, Any], float, float] | None = None  # (awaited, waited, started)
        self._run: str | None = None
        self._report_state: dict[str, Any] | None = None
        self.verdict: CollectiveDesyncError | None = None
        watching(self._group, +1)

    def close(self) -> None:
        """Stop counting as a watch of the group (failed collectives then wait for no verdict)."""
        watching(self._group, -1)

    def key(self, rank: int) -> str:
        """The store key of ``rank``'s summary."""
        return f"{self._prefix}collectives/{rank}"

    def summary(self) -> str:
        """This rank's summary for the heartbeat."""
        rec = self._recorder
        pending = rec.pending(self._group)
        last = rec.latest(self._group, _SUMMARY_RECORDS)
        stuck = None
        if pending and self._hang_timeout is not None:
            oldest = pending[0]
            waited = time.time() - oldest.started
            # The threshold is at least the timeout: the median (a sort of the ring) only past it.
            if waited > self._hang_timeout and waited > self._threshold(oldest):
                stuck = {"record": oldest.as_dict(), "waited": waited}
        seen = {r.seq: r for r in [*last, *pending]}
        body = {"records": [seen[s].as_dict() for s in sorted(seen)], "stuck": stuck}
        return json.dumps(body, separators=(",", ":"))

    def _threshold(self, record: CollectiveRecord) -> float:
        assert self._hang_timeout is not None
        median = self._recorder.median_duration(record)
        return max(self._hang_timeout, MEDIAN_FACTOR * median) if median is not None else self._hang_timeout

    def round(self, store: Store, summaries: Mapping[int, bytes]) -> CollectiveDesyncError | None:
        """Judge one heartbeat's summaries (this rank's included); a new desync verdict, or None."""
        parsed = {rank: _parse(raw, _MAX_SUMMARY_BYTES) for rank, raw in summaries.items()}
        bodies = {rank: body for rank, body in parsed.items() if isinstance(body, dict)}
        if self.verdict is None:
            windows = {rank: _records(body.get("records")) for rank, body in bodies.items()}
            found = find_desync(windows)
            if found is not None:
                self.verdict = CollectiveDesyncError(f"{found}. The process group cannot be used any more")
                self._recorder.set_verdict(self._group, self.verdict, self._process_group)
                self.write_dump(store, "desync", str(self.verdict))
                return self.verdict
        self._hang_round(store, bodies)
        return None

    # The hang report.

    def _hang_round(self, store: Store, bodies: Mapping[int, Mapping[str, Any]]) -> None:
        if self._report is None:
            stuck = [b["stuck"] for b in bodies.values() if isinstance(b.get("stuck"), dict)]
            stuck = [s for s in stuck if isinstance(s.get("record"), dict) and _valid_record(s["record"])]
            if not stuck:
                return
            first = min(stuck, key=lambda s: int(s["record"]["seq"]))
            seq = int(first["record"]["seq"])
            if seq in self._reported:
                return
            self._reported.add(seq)
            self._report = (first["record"], float(first.get("waited", 0.0)), time.monotonic())
            state = rank_state(self._rank, self._group, self._recorder, stacks=True)
            self._report_state = state
            store.set(self._report_key(seq, self._rank), _bounded_state(state))
            return
        awaited, waited, started = self._report
        seq = int(awaited["seq"])
        keys = {rank: self._report_key(seq, rank) for rank in range(self._world_size)}
        present = {rank for rank, key in keys.items() if store.check([key])}
        if len(present) < self._world_size and time.monotonic() - started < REPORT_WAIT_S:
            return
        self._report = None
        ranks = sorted(present)
        values = store.multi_get([keys[r] for r in ranks]) if ranks else []
        states: dict[int, Any] = dict.fromkeys(range(self._world_size))
        for rank, raw in zip(ranks, values):
            state = _parse(raw, _MAX_STATE_BYTES)
            states[rank] = state if _valid_state(state) else None
        waited += time.monotonic() - started
        lines = analyze_hang(awaited, states, waited)
        in_it = [
            r for r, s in states.items() if s is not None and any(int(p["seq"]) == seq for p in s["pending"])
        ]
        if in_it and self._rank == min(in_it):
            logger.error("Join hang report (rank %d):\n%s", self._rank, "\n".join(lines))
        else:
            logger.error("Join hang report: %s", lines[0])
        self.write_dump(
            store, "hang", "\n".join(lines), self._report_state, {"awaited": dict(awaited), "waited": waited}
        )

    def finish_report(self, store: Store) -> None:
        """Gather and write the report in progress, if any (the watch is ending)."""
        while self._report is not None:
            self._hang_round(store, {})
            time.sleep(0.1)

    def _report_key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}report/{seq}/{rank}"

    def write_dump(
        self,
        store: Store | None,
        kind: str,
        message: str,
        state: dict[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Write this rank's dump for a verdict or report of ``kind`` (``store``:
        where the run's name is agreed, None when it cannot be reached;
        ``state``: the one this rank reported, default: its state now)."""
        try:
            if self._run is None:
                self._run = dump.run_id(store)
            if state is None:
                state = rank_state(self._rank, self._group, self._recorder, stacks=True)
            path = dump.write(
                self._run, self._rank, self._world_size, kind, message, state, self._recorder, extra or {}
            )
            logger.error("Join: rank %d wrote its collective dump to %s", self._rank, path)
        except Exception as error:  # noqa: BLE001 - a dump must never hide the verdict
            logger.warning("Join: rank %d could not write its collective dump: %s", self._rank, error)


def _parse(raw: bytes, limit: int) -> Any:
    if len(raw) > limit:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _valid_record(record: Any) -> bool:
    try:
        return (
            isinstance(record, dict)
            and isinstance(record["op"], str)
            and isinstance(record["call_site"], str)
            and int(record["seq"]) >= 0
            and isinstance(int(record["fingerprint"]), int)
            and isinstance(record.get("shapes", []), list)
            and isinstance(record.get("dtypes", []), list)
        )
    except (KeyError, TypeError, ValueError):
        return False


def _records(value: Any) -> list[Mapping[str, Any]]:
    return [r for r in value if _valid_record(r)] if isinstance(value, list) else []


def _valid_state(state: Any) -> bool:
    try:
        return (
            isinstance(state, dict)
            and isinstance(state["where"], str)
            and int(state["last_seq"]) >= 0
            and all(_valid_record(r) for r in state["pending"])
            and all(_valid_record(r) for r in state["last"])
        )
    except (KeyError, TypeError, ValueError):
        return False


def _bounded_state(state: dict[str, Any]) -> str:
    text = json.dumps(state)
    while len(text) > _MAX_STATE_BYTES and state.get("stacks"):
        stacks: dict[str, list[str]] = state["stacks"]
        stacks.pop(next(iter(reversed(stacks))))
        text = json.dumps(state)
    return text


def comparable(states: Mapping[int, Mapping[str, Any]]) -> dict[int, Sequence[Mapping[str, Any]]]:
    """Per rank, the records of a full state (a dump) to compare."""
    return {rank: records_of(dict(state)) for rank, state in states.items()}
