"""bench/bench_lightning.py: a fit leaves no folder of its own behind."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import bench_lightning
import pytest

pytestmark = pytest.mark.timeout(300)

# A fresh interpreter, so that the ranks (forked from a server it starts) see its TMPDIR.
_FIT = textwrap.dedent(
    """
    import bench_lightning
    from join_core.testing import run_ranks

    times = run_ranks(bench_lightning._rounds, 1, 4, 1, timeout=240)[0]
    print(len(times["ours"]), len(times["lightning"]))
    """
)


def test_a_fit_removes_its_lightning_folder() -> None:
    bench = str(Path(bench_lightning.__file__).resolve().parent)
    path = os.pathsep.join(filter(None, [bench, os.environ.get("PYTHONPATH")]))
    # Not tmp_path: the fork server's socket must fit a Unix socket's path under TMPDIR.
    with tempfile.TemporaryDirectory() as temporary:
        env = dict(os.environ, TMPDIR=temporary, PYTHONPATH=path)
        done = subprocess.run(
            [sys.executable, "-c", _FIT], env=env, capture_output=True, text=True, timeout=280
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["1", "1"]  # one fit with each strategy
        assert sorted(p.name for p in Path(temporary).glob("bench-lightning-*")) == []
