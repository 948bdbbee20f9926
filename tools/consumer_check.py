"""Type-check a downstream file against the packages as users install them.

Builds a wheel of every package, installs the wheels (not the sources) into a
fresh virtual environment in .cache/consumer that sees only torch (from
.venvs/torch), and runs mypy --strict there on
tools/consumer/typed_consumer.py, from a folder outside the source tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dev

ROOT = dev.ROOT
CACHE = ROOT / ".cache" / "consumer"
MYPY = "mypy==2.4.1"


def main() -> int:
    wheels = CACHE / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    if dev.build_wheels(Path(sys.executable), wheels) != 0:
        return 1
    python = dev.torch_only_env(CACHE / "venv")
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
