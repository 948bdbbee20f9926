"""The peers' virtual environments, made with tools/dev.py's layering.

Ours and torch's RPC run in .venvs/run (every package of the repository, over
.venvs/torch); Ray and Monarch each in .venvs/peer-<name> over .venvs/torch,
pinned by ``dev.PEERS``, so that they see the one CPU torch and pip never
pulls another. A peer whose environment cannot be made, or whose library
does not import there, is reported with the reason rather than failing the run.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The environments are tools/dev.py's; the benchmark lives beside tools/, not in it.
_TOOLS = str(Path(__file__).resolve().parents[2] / "tools")
if _TOOLS not in sys.path:
    sys.path.append(_TOOLS)

import dev  # noqa: E402

__all__ = ["Ready", "Unavailable", "prepare"]


@dataclass(frozen=True)
class Ready:
    """A peer's environment is made: its python and the version of what it measures."""

    python: Path
    version: str


@dataclass(frozen=True)
class Unavailable:
    """A peer cannot run here, and why."""

    reason: str


_IMPORT_TIMEOUT_S = 300
_VERSION = "import importlib, importlib.metadata as m; importlib.import_module({module!r}); print(m.version({dist!r}))"


def prepare(env: str, module: str, dist: str) -> Ready | Unavailable:
    """Make environment ``env`` if needed and check that ``module`` imports in it; the
    installed version of distribution ``dist``."""
    try:
        python = dev.try_ensure(env)
    except dev.EnvSetupError as error:
        lines = [line for line in error.output.splitlines() if line.strip()]
        return Unavailable(f"pip could not install it: {lines[-1] if lines else error}")
    try:
        probe = subprocess.run(
            [str(python), "-c", _VERSION.format(module=module, dist=dist)],
            capture_output=True,
            text=True,
            timeout=_IMPORT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return Unavailable(f"`import {module}` took over {_IMPORT_TIMEOUT_S} s")
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.splitlines() if line.strip()]
        return Unavailable(f"`import {module}` fails: {lines[-1] if lines else f'exit {probe.returncode}'}")
    return Ready(python, probe.stdout.strip())
