"""torch_suites: the workers that run torch's suites fork with torch and the suites imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dev
import pytest

TOOLS = Path(__file__).resolve().parent.parent

# The CPU each worker of a fresh pool spent before it was ready (Linux: /proc).
_PROBE = """
import os, sys
sys.path.insert(0, sys.argv[1])  # as running tools/torch_suites.py puts its folder there
import torch_suites
pool = torch_suites.Pool(2)
try:
    pool.wait_ready()
    for proc in pool.procs:
        fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
        print((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
finally:
    pool.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the workers' CPU time in /proc")
def test_a_fresh_pools_workers_do_not_import_torch_and_the_suites_themselves() -> None:
    # Python 3.11's fork server skipped the "__main__" preload and ignored the sys.path it was
    # given: every worker imported torch and the suites again (seconds of CPU each).
    python = dev.ensure("suites")
    probe = subprocess.run(
        [str(python), "-c", _PROBE, str(TOOLS)], capture_output=True, text=True, timeout=240, cwd=TOOLS.parent
    )
    assert probe.returncode == 0, probe.stderr
    cpu = [float(line) for line in probe.stdout.split()]
    assert len(cpu) == 2 and max(cpu) < 1.0, cpu
