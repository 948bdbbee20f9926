"""tools/pytest_plugins/private_tmp.py: a test run's temporary files, its children's included, are
listed at its end and removed with the run's directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent.parent / "pytest_plugins"

TESTS = """\
import os
import subprocess
import sys
import tempfile
from pathlib import Path

def test_writes_temporary_files(tmp_path):
    run_dir = Path(tempfile.gettempdir())
    assert run_dir != Path(OUTER) and run_dir.parent == Path(OUTER)
    assert oct(run_dir.stat().st_mode & 0o7777) == "0o1777"
    (tmp_path / "pytest-own").write_text("x")
    (run_dir / "torchinductor_someone").mkdir()  # torch's compile cache
    Path(tempfile.mkdtemp(prefix="made-here-")).joinpath("dump.json").write_text("{}")
    code = "import tempfile; tempfile.mkstemp(prefix='made-by-a-child-')"
    subprocess.run([sys.executable, "-c", code], check=True)
    Path(OUTER, "run-dir").write_text(str(run_dir))
"""


def test_a_runs_temporary_files_are_listed_then_removed(tmp_path: Path) -> None:
    outer = tmp_path / "tmp"
    outer.mkdir()
    (tmp_path / "test_sample.py").write_text(TESTS.replace("OUTER", repr(str(outer))))
    plugins = ["-p", "private_tmp", "-p", "no:cacheprovider"]
    cmd = [sys.executable, "-m", "pytest", *plugins, "-q", "test_sample.py"]
    env = {"PYTHONPATH": str(PLUGINS), "PATH": "/usr/bin:/bin", "NO_COLOR": "1", "TMPDIR": str(outer)}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "left in the temporary directory (removed now)" in run.stdout
    listed = next(line for line in run.stdout.splitlines() if line.startswith("2 entries: "))
    assert "made-by-a-child-" in listed and "made-here-" in listed and "pytest-of-" not in listed
    assert "torchinductor_" not in listed
    run_dir = Path((outer / "run-dir").read_text())
    assert not run_dir.exists()
    assert sorted(p.name for p in outer.iterdir()) == ["run-dir"]
