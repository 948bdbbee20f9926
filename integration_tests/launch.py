"""Start one process per rank on this machine, as torchrun does.

    python integration_tests/launch.py --nproc 2 integration_tests/train_coordinated.py [ARGS...]

Every rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE):
this launcher hosts the rendezvous store on a port the OS picks, so the same
scripts run unchanged under ``torchrun --nproc-per-node N``. Each rank runs
in its own session; when one fails the others get a grace period, then
every rank still running is killed with its children. Nothing outlives the
launcher: a SIGTERM, SIGHUP or SIGINT to it kills every rank first, and on
Linux a rank is killed when its launcher dies of any signal, SIGKILL included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch.distributed as dist

# torch's stubs do not re-export the store class it documents publicly.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]


LineCallback = Callable[[int, str], None]

#: Signals that stop the launcher after it has killed every rank (SIGINT
#: does already: KeyboardInterrupt).
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)

# Run in each rank's interpreter before the script: the rank gets SIGKILL when
# its launcher dies (Linux's parent-death signal survives the exec).
_DIE_WITH_PARENT: Final = """
import ctypes, os, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except (AttributeError, OSError):
    pass  # not Linux: the launcher's own signal handling still applies
if os.getppid() != parent:
    sys.exit(137)  # the launcher died before the line above
os.execv(sys.argv[2], sys.argv[2:])
"""


@dataclass(frozen=True)
class RankExit:
    """How one rank ended."""

    rank: int
    pid: int  # also the id of the rank's session
    returncode: int  # negative: killed by that signal
    seconds: float
    output: str


def launch(
    script: Path,
    nproc: int,
    args: list[str] | None = None,
    timeout: float = 300.0,
    grace: float = 30.0,
    env: dict[str, str] | None = None,
    on_line: LineCallback | None = None,
) -> list[RankExit]:
    """Run ``script`` on ``nproc`` local ranks and wait for all of them.

    Args:
        script: the Python file each rank runs.
        nproc: the number of ranks.
        args: command-line arguments for the script.
        timeout: seconds before every rank still running is killed.
        grace: after a rank fails, seconds the others get before being killed.
        env: extra environment variables for every rank.
        on_line: called with (rank, line) for each line a rank prints, as it comes.
    """
    if nproc < 1:
        raise ValueError(f"launch(nproc={nproc}): need at least one rank")
    store = TCPStore(
        "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    base_env = dict(os.environ, **(env or {}))
    base_env.update(
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=base_env.get("OMP_NUM_THREADS", "1"),
    )
    start = time.monotonic()
    procs = []
    outputs: list[list[str]] = []
    readers = []
    for rank in range(nproc):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _DIE_WITH_PARENT,
                str(os.getpid()),
                sys.executable,
                str(script),
                *(args or []),
            ],
            env=dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)
        outputs.append([])
        reader = threading.Thread(target=_read, args=(rank, proc, outputs[rank], on_line), daemon=True)
        reader.start()
        readers.append(reader)
    ended: dict[int, float] = {}
    deadline = start + timeout
    previous = _stop_on_signals()
    try:
        while len(ended) < nproc and time.monotonic() < deadline:
            for rank, proc in enumerate(procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = time.monotonic() - start
                    if proc.returncode != 0:
                        deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.05)
    finally:
        for rank, proc in enumerate(procs):
            _kill_session(proc)
            if rank not in ended:
                ended[rank] = time.monotonic() - start
        for reader, proc in zip(readers, procs):
            reader.join(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        del store
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    exits = []
    for rank, proc in enumerate(procs):
        exits.append(RankExit(rank, proc.pid, proc.returncode, ended[rank], "".join(outputs[rank])))
    return exits


def _stop_on_signals() -> dict[int, Any]:
    """Make STOP_SIGNALS raise SystemExit (so that the ranks are killed on the way out)
    while ranks run; the handlers it replaced. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}


def _read(rank: int, proc: subprocess.Popen[str], lines: list[str], on_line: LineCallback | None) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if on_line is not None:
            on_line(rank, line)


def _kill_session(proc: subprocess.Popen[str]) -> None:
    """Kill the rank and every process it started (its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def session_alive(pid: int) -> bool:
    """Whether any process of the session led by ``pid`` still exists."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="number of local ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before ranks are killed")
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    exits = launch(ns.script, ns.nproc, ns.args, timeout=ns.timeout)
    for e in exits:
        sys.stdout.write(e.output)
    failed = [e.rank for e in exits if e.returncode != 0]
    if failed:
        print(f"ranks failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
