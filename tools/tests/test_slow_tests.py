"""tools/pytest_plugins/slow_tests.py: a test past the limit fails the run unless a reason is beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent.parent / "pytest_plugins"

TESTS = """\
import time
import pytest

def test_fast():
    pass

@pytest.mark.slow(reason="waits out a peer's liveness timeout")
def test_explained():
    time.sleep(0.5)

def test_unexplained():
    time.sleep(UNEXPLAINED_S)
"""


def _run(tmp_path: Path, unexplained_s: float, *extra: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(TESTS.replace("UNEXPLAINED_S", str(unexplained_s)))
    (tmp_path / "pytest.ini").write_text("[pytest]\nslow_test_limit = 0.3\n")
    cmd = [sys.executable, "-m", "pytest", "-p", "slow_tests", "-p", "no:cacheprovider", "-q", *extra]
    env = {"PYTHONPATH": str(PLUGINS), "PATH": "/usr/bin:/bin", "NO_COLOR": "1"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_slow_test_without_a_reason_fails_the_run_and_is_named(tmp_path: Path) -> None:
    run = _run(tmp_path, 0.5)
    assert run.returncode == 1, run.stdout
    assert "3 passed" in run.stdout
    assert "test_sample.py::test_unexplained: NO REASON" in run.stdout
    assert "test_sample.py::test_explained: waits out a peer's liveness timeout" in run.stdout


def test_slow_tests_with_reasons_pass_and_are_listed(tmp_path: Path) -> None:
    run = _run(tmp_path, 0.0)
    assert run.returncode == 0, run.stdout
    assert "tests past 0.3 s" in run.stdout
    assert "test_sample.py::test_explained: waits out a peer's liveness timeout" in run.stdout
    assert "NO REASON" not in run.stdout


def test_a_slow_mark_without_a_reason_is_refused(tmp_path: Path) -> None:
    (tmp_path / "test_bare.py").write_text("import pytest\n\n@pytest.mark.slow\ndef test_x():\n    pass\n")
    run = _run(tmp_path, 0.0, "test_bare.py")
    assert run.returncode != 0
    assert "@pytest.mark.slow needs reason=" in run.stdout + run.stderr
