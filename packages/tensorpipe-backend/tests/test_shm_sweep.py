"""Shared-memory files of a killed worker do not outlive it."""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest
from tpb_workers import CONTEXT, share_then_die

from tensorpipe_backend.shm import SharedFiles, host_identity, sweep_dead_senders

pytestmark = [pytest.mark.skipif(not host_identity(), reason="no usable /dev/shm"), pytest.mark.timeout(180)]

#: A spawned child imports torch first: on a loaded machine that alone can take most of a minute.
_REPORT_TIMEOUT_S = 120


def _files_of(pid: int) -> list[str]:
    prefix = f"tpb-{pid:08x}"
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def _killed_sender() -> int:
    sent = CONTEXT.Queue()
    worker = CONTEXT.Process(target=share_then_die, args=(sent,), daemon=True)
    worker.start()
    deadline = time.monotonic() + _REPORT_TIMEOUT_S
    while True:
        try:
            report: int | str = sent.get(timeout=1)
            break
        except queue.Empty:
            assert worker.is_alive(), f"the sender exited with code {worker.exitcode} before reporting"
            assert time.monotonic() < deadline, f"the sender did not report within {_REPORT_TIMEOUT_S} s"
    assert isinstance(report, int), f"the sender failed: {report}"
    pid = report
    assert len(_files_of(pid)) >= 2
    os.kill(pid, signal.SIGKILL)
    worker.join(timeout=10)
    return pid


def test_a_closed_connection_sweeps_the_files_of_a_killed_sender() -> None:
    pid = _killed_sender()
    SharedFiles().close()  # what a survivor does when its connection to the dead worker closes
    assert _files_of(pid) == []


def test_files_of_a_live_sender_stay() -> None:
    files = SharedFiles()
    try:
        files.write(memoryview(bytearray(1 << 20)))
        sweep_dead_senders()
        assert len(_files_of(os.getpid())) == 1
    finally:
        files.close()
    assert _files_of(os.getpid()) == []
