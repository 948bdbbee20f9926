"""Reading the ranks' states into a verdict that names the culprit.

Each rank describes itself as a *state* (a JSON-ready dict, see
:func:`rank_state`): its pending collectives, its last ones on the watched
group, where its main thread is, and the stacks of all its threads. The
functions here turn the states of all ranks into the report's lines; the
watch (:mod:`join_core.collective_watch`) and ``python -m join_core.trace``
call the same ones, so a dump read later gives the same first line.
"""

from __future__ import annotations

import os
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any, Final

from join_core.recorder import CollectiveRecorder, is_internal

__all__ = ["analyze_hang", "find_desync", "rank_state"]

#: Records of the watched group each state carries.
LAST_RECORDS: Final = 5
_MAX_STACK_FRAMES: Final = 40
_STDLIB: Final = os.path.join(os.path.realpath(sysconfig.get_paths()["stdlib"]), "")

State = dict[str, Any]


def rank_state(rank: int, group: str, rec: CollectiveRecorder, stacks: bool) -> State:
    """This rank's state on ``group``; with ``stacks``, every thread's Python stack."""
    records = rec.records(group)
    state: State = {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "group": group,
        "pending": [r.as_dict() for r in rec.pending(group)],
        "last": [r.as_dict() for r in records[-LAST_RECORDS:]],
        "last_seq": records[-1].seq if records else 0,
        "where": main_thread_site(),
    }
    if stacks:
        state["stacks"] = thread_stacks()
    return state


def main_thread_site() -> str:
    """``file.py:LINE function()`` of the main thread's innermost frame in user code."""
    found = None
    # Another thread's frames come apart as it returns from them: look again then.
    for _ in range(20):
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        if frame is None:
            return "(the main thread has ended)"
        found = _user_site(frame)
        if found is not None:
            return found
        time.sleep(0.001)
    return "(outside user code)"


def thread_stacks() -> dict[str, list[str]]:
    """Every other thread's stack, innermost call last, by ``name (id)``."""
    names = {t.ident: t.name for t in threading.enumerate()}
    found = {}
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watch itself, taking the stacks
        lines = traceback.format_stack(frame, limit=_MAX_STACK_FRAMES)
        found[f"{names.get(ident, 'thread')} ({ident})"] = [line.rstrip() for line in lines]
    return found


def _user_site(frame: FrameType) -> str | None:
    current: FrameType | None = frame
    while current is not None:
        code = current.f_code
        path = os.path.realpath(code.co_filename)
        if not path.startswith(_STDLIB) and not is_internal(code):
            return f"{os.path.basename(code.co_filename)}:{current.f_lineno} {code.co_name}()"
        current = current.f_back
    return None


def _describe(record: Mapping[str, Any]) -> str:
    shapes, dtypes = record.get("shapes") or [], record.get("dtypes") or []
    tensors = ", ".join(f"{d}{s}" for s, d in zip(shapes, dtypes)) if shapes else ", ".join(dtypes)
    head = f"{record['op']} #{record['seq']}"
    return f"{head} ({tensors})" if tensors else head


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def find_desync(states: Mapping[int, Sequence[Mapping[str, Any]]]) -> str | None:
    """The first sequence number at which the ranks' records differ, told as
    each side's call and call site; None if every shared number matches.

    Args:
        states: per rank, its latest records on one group (pending ones too).
    """
    by_seq: dict[int, dict[int, list[int]]] = {}  # seq -> fingerprint -> ranks
    example: dict[tuple[int, int], Mapping[str, Any]] = {}
    for rank, records in states.items():
        for record in records:
            seq, fingerprint = int(record["seq"]), int(record["fingerprint"])
            ranks = by_seq.setdefault(seq, {}).setdefault(fingerprint, [])
            if rank not in ranks:
                ranks.append(rank)
            example.setdefault((seq, fingerprint), record)
    for seq in sorted(by_seq):
        sides = by_seq[seq]
        if len(sides) < 2:
            continue
        told = sorted(sides.items(), key=lambda item: min(item[1]))
        parts = [
            f"{_ranks(sorted(ranks))} called {_describe(example[(seq, fp)])} at {example[(seq, fp)]['call_site']}"
            for fp, ranks in told
        ]
        return f"collectives out of step at #{seq}: " + "; ".join(parts)
    return None


def analyze_hang(
    awaited: Mapping[str, Any], states: Mapping[int, State | None], waited_s: float
) -> list[str]:
    """The hang report's lines; the first names the culprit and why.

    Args:
        awaited: the record of the collective that waited too long.
        states: every rank's state (None: it did not answer).
        waited_s: how long it had waited.
    """
    seq, fingerprint = int(awaited["seq"]), int(awaited["fingerprint"])
    what = _describe(awaited)
    waiting: list[int] = []
    findings: list[tuple[int, str]] = []
    for rank in sorted(states):
        state = states[rank]
        if state is None:
            findings.append(
                (rank, f"rank {rank} did not answer the hang report: it is frozen, dead or cut off")
            )
            continue
        pending = {int(r["seq"]): r for r in state["pending"]}
        mine = pending.get(seq)
        if mine is not None and int(mine["fingerprint"]) == fingerprint:
            waiting.append(rank)
            continue
        if mine is not None:
            findings.append(
                (
                    rank,
                    f"rank {rank} called {_describe(mine)} at {mine['call_site']} where the others "
                    f"wait in {what} at {awaited['call_site']}",
                )
            )
            continue
        last_seq = int(state["last_seq"])
        if last_seq < seq:
            inside = sorted(pending.values(), key=lambda r: int(r["seq"]))
            doing = (
                f"it waits in {_describe(inside[0])} at {inside[0]['call_site']}"
                if inside
                else f"it is in {state['where']}"
            )
            findings.append((rank, f"rank {rank} never entered {what} (it issued #{last_seq} last): {doing}"))
        else:
            findings.append(
                (
                    rank,
                    f"rank {rank} already completed #{seq} and issued up to #{last_seq}, so the ranks' "
                    f"collectives are out of step (a collective skipped or added): it is in {state['where']}",
                )
            )
    lines = []
    if findings:
        first = findings[0][1]
        if waiting:
            first += f"; {_ranks(waiting)} wait in {what} at {awaited['call_site']} for {waited_s:.0f} s"
        lines.append(first)
        lines += [text for _, text in findings[1:]]
    else:
        lines.append(
            f"every rank is in {what} at {awaited['call_site']} for {waited_s:.0f} s: the backend is stuck"
        )
    for rank, _ in findings:
        state = states[rank]
        if state is None or "stacks" not in state:
            continue
        lines.append(f"--- rank {rank} (pid {state['pid']} on {state['host']}), every thread:")
        for thread, stack in state["stacks"].items():
            lines.append(f"  {thread}:")
            lines += [f"    {line}" for entry in stack for line in entry.splitlines()]
    return lines


def records_of(state: State) -> list[Mapping[str, Any]]:
    """A state's records for comparison: its latest and its pending ones."""
    seen = {int(r["seq"]): r for r in state["last"]}
    seen.update({int(r["seq"]): r for r in state["pending"]})
    return [seen[s] for s in sorted(seen)]
