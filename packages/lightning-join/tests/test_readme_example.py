"""The README's Trainer example under Lightning's own launcher (the docs check
runs it under torchrun's environment)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
TIMEOUT_S = 120.0


def test_readme_example_runs_with_lightnings_launcher() -> None:
    example = re.search(r"^```python\n(.*?)^```$", README.read_text(), re.MULTILINE | re.DOTALL)
    assert example is not None and "Trainer(" in example.group(1)
    # Lightning's launcher starts rank 1 itself: no torchrun variables may leak in.
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "example.py"
        script.write_text(example.group(1))
        # Its own session, so that a hang is ended with every process Lightning started.
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise AssertionError(f"did not finish within {TIMEOUT_S:g} s:\n{output}") from None
    assert proc.returncode == 0, output
    assert "distributed_backend=gloo" in output and "All distributed processes registered" in output, output
