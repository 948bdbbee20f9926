"""torchft's time from a lost replica to the survivors' next committed step, beside ours.

    python3 tools/dev.py bench --only continue [--quick]   # in the section's table
    .venvs/run/bin/python bench/bench_torchft.py [RUNS]     # torchft's figures alone

torchft (``torchft==0.2.0`` and what it needs, pinned in ``dev.PEERS``) installs
into .venvs/peer-torchft over .venvs/torch, so it runs on the one CPU torch
and the run environment never sees it. bench/bench_torchft_replicas.py runs
there, in processes of its own: a ``torchft_lighthouse``, 3 replica groups
of one process training the MLP, one of them killed (SIGKILL) in iteration 5.

Two lighthouse settings are measured. As torchft's README runs it
(``--join_timeout_ms 10000``), the survivors' quorum waits until the lost
replica's heartbeats are older than ``heartbeat_timeout_ms`` (5000, the
default), so the figure is about 5 s. With ``--join_timeout_ms 100`` (what
its Python ``LighthouseServer``, meant for tests, defaults to), the
lighthouse stops waiting for a replica that has not asked for the quorum
after 100 ms. No other timeout of torchft is changed.

If torchft cannot be installed or run here, the figures say why with no
number; the bench run goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from benchlib import Figure
from peers.environments import Ready, prepare

__all__ = ["Recovery", "torchft_figures", "torchft_recovery"]

ENV: Final = "peer-torchft"
#: The lighthouse's --join_timeout_ms in torchft's README, and in its Python LighthouseServer.
README_JOIN_TIMEOUT_MS: Final = 10000
SERVER_JOIN_TIMEOUT_MS: Final = 100
_SCRIPT: Final = Path(__file__).resolve().parent / "bench_torchft_replicas.py"
_RUN_TIMEOUT_S: Final = 180.0


@dataclass(frozen=True)
class Recovery:
    """torchft's seconds from the loss to the survivors' next committed step (median of the
    completed runs; NaN if none), and what was measured or why nothing was."""

    seconds: float
    completed: int
    runs: int
    version: str = ""  # torchft's version; "" when it could not run
    reason: str = ""  # why no run completed; or why some did not


def _last_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line or "expected" in line]
    return (errors or lines or ["no output"])[-1][:300]


def _run_once(python: Path, join_timeout_ms: int) -> float | str:
    """One run in fresh processes: the seconds, or why there are none."""
    with tempfile.TemporaryDirectory(prefix="bench-torchft-") as folder:
        out = Path(folder)
        command = [str(python), str(_SCRIPT), "--out", str(out), "--join-timeout-ms", str(join_timeout_ms)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(out / "driver.log", "w+") as log:
            # A session of its own: whatever is left of it goes with it below.
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                proc.wait(timeout=_RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return f"timed out after {_RUN_TIMEOUT_S:.0f} s"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            log.seek(0)
            if proc.returncode != 0:
                return f"exit {proc.returncode}: {_last_line(log.read())}"
        result = json.loads((out / "result.json").read_text())
        if (result["participants_before"], result["participants_after"]) != (3, 2):
            return f"quorum of {result['participants_before']} before the loss and {result['participants_after']} after, expected 3 and 2"
        seconds: float = result["seconds"]
        return seconds


def torchft_recovery(runs: int, join_timeout_ms: int = README_JOIN_TIMEOUT_MS) -> Recovery:
    """torchft's recovery time over ``runs`` runs (each in fresh processes), its lighthouse
    run with ``--join_timeout_ms join_timeout_ms``."""
    if runs < 1:
        raise ValueError(f"runs={runs}: need at least 1 run")
    prepared = prepare(ENV, "torchft", "torchft")
    if not isinstance(prepared, Ready):
        return Recovery(float("nan"), 0, runs, reason=prepared.reason)
    times: list[float] = []
    failures: list[str] = []
    for run in range(runs):
        found = _run_once(prepared.python, join_timeout_ms)
        if isinstance(found, str):
            print(
                f"torchft {prepared.version}, join timeout {join_timeout_ms} ms, run {run + 1}: failed: {found}"
            )
            failures.append(found)
        else:
            print(
                f"torchft {prepared.version}, join timeout {join_timeout_ms} ms, run {run + 1}: {found:.3f} s"
            )
            times.append(found)
    seconds = statistics.median(times) if times else float("nan")
    reason = f"{len(failures)} of {runs} runs failed: {failures[-1]}" if failures else ""
    return Recovery(seconds, len(times), runs, prepared.version, reason)


def torchft_figures(ours: float, runs: int) -> list[Figure]:
    """Our SIGKILL recovery (``ours``, seconds) beside torchft's, with the lighthouse as
    torchft's README runs it and with a 100 ms join timeout."""
    figures = []
    for join_timeout_ms, lighthouse, why in (
        (
            README_JOIN_TIMEOUT_MS,
            "lighthouse as its README runs it",
            "; the quorum waits out the lost replica's heartbeat timeout, 5 s",
        ),
        (SERVER_JOIN_TIMEOUT_MS, "lighthouse --join_timeout_ms 100", ""),
    ):
        found = torchft_recovery(runs, join_timeout_ms)
        what = f"torchft {found.version or '0.2.0'}, 3 replica groups"
        if found.completed:
            reference = f"{what}: loss to the survivors' next committed step{why}"
            if found.reason:
                reference += f"; {found.reason}"
            print(
                f"{what}, {lighthouse}: survivors' next committed step {found.seconds:.2f} s after the loss"
            )
        else:
            reference = f"{what}: not measured: {found.reason}"
            print(f"{what}, {lighthouse}: not measured: {found.reason}")
        figures.append(
            Figure(
                f"loss of 1 of 3 ranks (SIGKILL) to the survivors' next step, MLP: ours against torchft, {lighthouse}",
                "s",
                ours,
                found.seconds,
                "(context)",
                found.seconds / ours,
                True,
                reference=reference,
            )
        )
    return figures


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for join_timeout in (README_JOIN_TIMEOUT_MS, SERVER_JOIN_TIMEOUT_MS):
        print(f"--join_timeout_ms {join_timeout}: {torchft_recovery(count, join_timeout)}")
