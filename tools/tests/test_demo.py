"""The demo as a user meets it: one sentence for a device it cannot use, live progress on a terminal."""

from __future__ import annotations

import os
import pty
import select
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
