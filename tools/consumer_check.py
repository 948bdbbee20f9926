"""Type-check a downstream file against the packages as users install them.

Builds a wheel of every package, installs the wheels (not the sources) into a
fresh virtual environment in .cache/consumer, and runs mypy --strict there on
tools/consumer/typed_consumer.py, from a folder outside the source tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "consumer"
MYPY = "mypy==2.4.1"


def main() -> int:
    wheels = CACHE / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    packages = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
    for package in packages:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(package)],
            check=True,
        )
    env_dir = CACHE / "venv"
    venv.create(env_dir, with_pip=True, clear=True)
    python = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    built = sorted(str(w) for w in wheels.glob("*.whl"))
    print("installing " + ", ".join(Path(w).name for w in built), flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *built, MYPY], check=True)
    with tempfile.TemporaryDirectory() as outside:
        consumer = Path(outside) / "typed_consumer.py"
        shutil.copy(ROOT / "tools" / "consumer" / "typed_consumer.py", consumer)
        cmd = [str(python), "-m", "mypy", "--strict", "--warn-unreachable", str(consumer)]
        return subprocess.run(cmd, cwd=outside).returncode


if __name__ == "__main__":
    sys.exit(main())
