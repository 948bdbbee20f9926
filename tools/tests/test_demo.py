"""The demo as a user meets it: one sentence for a device it cannot use, live progress on a terminal."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent.parent


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "tools/demo.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_nccl_without_cuda_is_one_sentence_before_any_rank_starts() -> None:
    result = _demo("--backend", "nccl")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "demo: --backend nccl runs on CUDA devices only: add --device cuda, or use --backend gloo"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable CUDA device")
def test_cuda_without_a_usable_device_is_one_sentence() -> None:
    result = _demo("--device", "cuda")
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("demo: --device cuda: no usable CUDA device") and line.endswith("use --device cpu")


@pytest.mark.slow(
    reason="the whole demo through dev.py: its launcher and ranks import torch, train and evaluate (about 40 s on two cores)"
)
def test_demo_through_dev_draws_live_progress_on_a_terminal_without_numpy_warnings() -> None:
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "tools/dev.py", "demo", "--base", "2", "--extra", "1"],
        cwd=ROOT,
        stdin=child,
        stdout=child,
        stderr=child,
        env=dict(os.environ, TERM="xterm-256color", COLUMNS="100"),
    )
    os.close(child)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal closed: the demo ended
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        os.close(main)
    out = b"".join(chunks).decode(errors="replace")
    assert "\x1b[?25l" in out, out  # rich hid the cursor: it drew a live display
    assert "rank 1" in out and "every rank holds the same model: yes" in out
    assert "Failed to initialize NumPy" not in out


def _processes() -> dict[int, tuple[int, str, str]]:
    """Every process: pid -> (parent pid, state, command line)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, UnicodeDecodeError):
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            found[int(entry)] = (int(ppid), state, cmdline)
    return found


def _descendants(pid: int) -> dict[int, str]:
    """The processes below ``pid``, with their command lines."""
    processes = _processes()
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _, cmdline) in processes.items():
            if ppid == parent and child not in found:
                found[child] = cmdline
                todo.append(child)
    return found


def _running(pids: list[int]) -> list[int]:
    processes = _processes()
    return [p for p in pids if p in processes and processes[p][1] != "Z"]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc, and relies on Linux's parent-death signal")
@pytest.mark.parametrize(
    ("target", "signum"),
    [("dev", signal.SIGTERM), ("dev", signal.SIGKILL), ("demo", signal.SIGKILL)],
    ids=["SIGTERM-to-dev.py", "SIGKILL-to-dev.py", "SIGKILL-to-demo.py"],
)
def test_a_signal_to_dev_demo_stops_every_rank(target: str, signum: int) -> None:
    proc = subprocess.Popen(
        # Ctrl-C acts on a terminal's foreground job, even when these tests run in the background of
        # a shell without job control, which makes its jobs ignore SIGINT (inherited across exec).
        [
            sys.executable,
            "-c",
            _SIGINT_AT_DEFAULT,
            "tools/dev.py",
            "demo",
            "--base",
            "1000000",
            "--extra",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the demo started no 2 ranks"
            time.sleep(0.2)
            below = _descendants(proc.pid)
            ranks = {p: c for p, c in below.items() if "train_coordinated.py" in c and " -c " not in c}
        demo = next(p for p, c in below.items() if "tools/demo.py" in c and " -c " not in c)
        os.kill(proc.pid if target == "dev" else demo, signum)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _running(list(ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(list(ranks)) == [], f"ranks still running after {signum!r} to {target}"
    finally:
        for pid in [proc.pid, *_running(list(ranks))]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)


_SIGINT_AT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_ctrl_c_stops_the_demo_and_its_ranks_with_one_line() -> None:
    proc = subprocess.Popen(
        # Ctrl-C acts on a terminal's foreground job, even when these tests run in the background of
        # a shell without job control, which makes its jobs ignore SIGINT (inherited across exec).
        [
            sys.executable,
            "-c",
            _SIGINT_AT_DEFAULT,
            "tools/dev.py",
            "demo",
            "--base",
            "1000000",
            "--extra",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    ranks: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the demo started no 2 ranks"
            time.sleep(0.2)
            below = _descendants(proc.pid)
            ranks = {p: c for p, c in below.items() if "train_coordinated.py" in c and " -c " not in c}
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Where it is stuck: the demo dumps its threads' stacks on SIGUSR1.
            for pid, command in _descendants(proc.pid).items():
                if "tools/demo.py" in command and " -c " not in command:
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
            raise AssertionError(f"the demo did not stop within 60 s of Ctrl-C:\n{out}") from None
        assert proc.returncode == 130, out
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
        assert [line for line in out.splitlines() if "interrupted" in line] == [
            next(line for line in out.splitlines() if line.startswith("demo: interrupted after"))
        ]
        assert _running(list(ranks)) == []
    finally:
        for pid in [proc.pid, *_running(list(ranks))]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
