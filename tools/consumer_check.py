"""Type-check a downstream file against the packages as users install them.

Builds a wheel of every package, installs the wheels (not the sources) into a
fresh virtual environment in .cache/consumer that sees only torch (from
.venvs/torch), and runs mypy --strict there on
tools/consumer/typed_consumer.py, from a folder outside the source tree;
then tools/pyright_check.py there: every package's type completeness
(``pyright --verifytypes``, 100 %) and the same file in pyright's strict mode
(skipped, saying so, without Node.js, which pyright runs on).
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
PYRIGHT = "pyright==1.1.414"


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
        if subprocess.run(cmd, cwd=outside).returncode != 0:
            return 1
    if shutil.which("node") is None:
        print("pyright: skipped: Node.js not found on PATH (pyright runs on it)", flush=True)
        return 0
    subprocess.run([str(python), "-m", "pip", "install", "-q", PYRIGHT], check=True)
    check = [str(python), str(ROOT / "tools" / "pyright_check.py"), "--python", str(python)]
    return subprocess.run(check, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
