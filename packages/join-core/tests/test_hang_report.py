"""Every hang named: a rank elsewhere than the others' collective is named in
the hang report's first line, with what it is doing; ranks whose collectives
go out of step raise CollectiveDesyncError naming both calls."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from counting_joinable import CountingJoinable
from torch.distributed import all_reduce as imported_all_reduce

import join_core
from join_core import CollectiveDesyncError, Join, watch_collectives
from join_core.testing import run_ranks
from join_core.trace import analyze_dumps

HANG_TIMEOUT = timedelta(seconds=2)
#: Two heartbeats (one to publish, one to read): 1.0-1.9 s measured at load 27; one beat more of room.
DESYNC_TOLD_WITHIN_S = 3.0
#: Hang timeout, plus the heartbeats it takes to see it and gather the report.
REPORT_WITHIN_S = 2 + 10


def _report(dump_dir: str, rank: int) -> list[str] | None:
    """The hang report rank ``rank`` dumped, as lines, or None yet."""
    for run in Path(dump_dir).glob("*"):
        path = run / f"rank-{rank}.json"
        if path.is_file():
            content = json.loads(path.read_text())
            if content["kind"] == "hang":
                lines: list[str] = content["message"].splitlines()
                return lines
    return None


def _wait_for_report(dump_dir: str) -> None:
    """Stand-in for a long stall: returns once rank 0 has dumped its hang report."""
    deadline = time.monotonic() + REPORT_WITHIN_S + 20
    while _report(dump_dir, 0) is None:
        if time.monotonic() > deadline:
            raise AssertionError("no hang report was dumped")


def spin_forever(dump_dir: str) -> None:
    """An 'infinite' loop in user code (it ends once the report is out)."""
    while not any(Path(dump_dir).glob("*/rank-0.json")):
        sum(range(1000))


def load_batch(dump_dir: str) -> None:
    """A data loader whose worker never delivers (until the report is out)."""
    batches: queue.Queue[int] = queue.Queue()

    def worker() -> None:
        _wait_for_report(dump_dir)
        batches.put(1)

    threading.Thread(target=worker, name="loader-worker").start()
    batches.get(timeout=60)


def _stalled_rank(rank: int, world_size: int, dump_dir: str, how: str) -> tuple[list[str], float, int]:
    os.environ["JOIN_CORE_DUMP_DIR"] = dump_dir  # the ranks' processes outlive one test's environment
    joinable = CountingJoinable(False)
    x = torch.ones(4)
    with Join([joinable], hang_timeout=HANG_TIMEOUT):
        for i in range(3):
            joinable.step(1.0)
            if i == 2:
                started = time.monotonic()
            if rank == 2 and i == 2:
                if how == "spin":
                    spin_forever(dump_dir)
                else:
                    load_batch(dump_dir)
            dist.all_reduce(x)  # the awaited collective at i == 2
            if i == 2:
                recorder = join_core.recorder()
                assert recorder is not None
                awaited = recorder.records()[-1].seq
    took = time.monotonic() - started
    deadline = time.monotonic() + REPORT_WITHIN_S
    while (lines := _report(dump_dir, rank)) is None:  # each rank gathers the others' states on its own
        assert time.monotonic() < deadline, f"rank {rank} dumped no hang report"
        time.sleep(0.1)
    return lines, took, awaited


@pytest.mark.parametrize("how", ["spin", "loader"])
def test_hang_report_names_the_rank_that_never_entered(how: str, tmp_path: Path) -> None:
    results = run_ranks(_stalled_rank, 3, str(tmp_path), how, timeout=90)
    where = "spin_forever()" if how == "spin" else "load_batch()"
    for lines, _, awaited in results:
        first = lines[0]
        assert first.startswith(f"rank 2 never entered all_reduce #{awaited} "), first
        assert "it is in test_hang_report.py:" in first and where in first, first
        assert "ranks 0, 1 wait in all_reduce #" in first and "_stalled_rank()" in first, first
    assert results[0][1] < REPORT_WITHIN_S, f"reported after {results[0][1]:.1f} s"
    # The culprit's stacks are in the report, every thread of it.
    text = "\n".join(results[0][0])
    assert "--- rank 2" in text and "MainThread" in text
    if how == "loader":
        assert "loader-worker" in text
    # The dumps tell the same, read later by the trace command.
    traced = subprocess.run(
        [sys.executable, "-m", "join_core.trace", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert traced[1] == results[0][0][0], traced[:2]


def _desync(rank: int, world_size: int, dump_dir: str, how: str, imported: bool) -> tuple[str, float]:
    os.environ["JOIN_CORE_DUMP_DIR"] = dump_dir
    joinable = CountingJoinable(False)
    grads, loss = torch.ones(4), torch.ones(1)
    reduce = imported_all_reduce if imported else dist.all_reduce
    deadline = time.monotonic() + 30
    with pytest.raises(CollectiveDesyncError) as raised, Join([joinable], hang_timeout=None):
        i = 0
        while time.monotonic() < deadline:
            joinable.step(1.0)
            if i == 3:
                out_of_step = time.monotonic()
            if how == "skip" and rank == 2 and i == 3:
                pass  # skips this iteration's gradient all-reduce
            elif how == "shapes" and rank == 1 and i == 3:
                reduce(torch.ones(3))
            elif how == "broadcast" and rank == 2 and i == 3:
                dist.broadcast(grads, src=0)
            else:
                reduce(grads)
            reduce(loss)
            i += 1
            time.sleep(0.01)
    return str(raised.value), time.monotonic() - out_of_step


@pytest.mark.parametrize(("how", "imported"), [("skip", False), ("shapes", True), ("broadcast", False)])
def test_desync_is_raised_on_every_rank_naming_both_calls(how: str, imported: bool, tmp_path: Path) -> None:
    results = run_ranks(_desync, 3, str(tmp_path), how, imported, timeout=90)
    messages = [message for message, _ in results]
    told_after = max(after for _, after in results)
    assert told_after < DESYNC_TOLD_WITHIN_S, f"told after {told_after:.1f} s"
    odd = {
        "skip": "rank 2 called all_reduce",
        "shapes": "rank 1 called all_reduce",
        "broadcast": "rank 2 called broadcast",
    }[how]
    for message in messages:
        assert "collectives out of step at #" in message, message
        assert odd in message, message
        assert "test_hang_report.py:" in message and "_desync()" in message, message
    (run,) = tmp_path.iterdir()
    # The dumps hold every rank's records: the same call out of step, and each side named.
    assert odd in analyze_dumps(run)[0] and analyze_dumps(run)[0].startswith(messages[0].split(":")[0])


def _plain_script_desync(rank: int, world_size: int, dump_dir: str) -> str:
    os.environ["JOIN_CORE_DUMP_DIR"] = dump_dir
    watch_collectives(hang_timeout=None)
    with pytest.raises(CollectiveDesyncError) as raised:
        for i in range(3000):
            imported_all_reduce(torch.ones(1 if (rank == 0 and i == 5) else 2))
            time.sleep(0.01)
    return str(raised.value)


def test_watch_collectives_raises_desync_in_a_plain_script(tmp_path: Path) -> None:
    for message in run_ranks(_plain_script_desync, 2, str(tmp_path), timeout=90):
        assert "rank 0 called all_reduce" in message and "float32[1]" in message, message
        assert "rank 1 called all_reduce" in message and "float32[2]" in message, message
