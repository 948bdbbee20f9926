"""mypy --strict (mypy.ini) over every package's sources and tests.

Each package is checked on its own, with its tests folder on the path, so
test helper modules of different packages never collide; then the
integration runs, the tools and the benchmark (bench/) together.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    failed = []
    for package in sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml")):
        targets = [str(package / "src"), str(package / "tests")]
        env = dict(os.environ, MYPYPATH=str(package / "tests"))
        print(f"mypy: {package.name}", flush=True)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"), *targets]
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
            failed.append(package.name)
    # The integration runs, the tools (the demo imports the launcher) and the benchmark
    # (it imports tools/dev.py; an integration run imports it) together.
    folders = [f for f in ("integration_tests", "tools", "bench") if (ROOT / f).is_dir()]
    print(f"mypy: {', '.join(folders)}", flush=True)
    env = dict(os.environ, MYPYPATH=os.pathsep.join(str(ROOT / f) for f in folders))
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"), *folders]
    if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
        failed.extend(folders)
    if failed:
        print("mypy failed for: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
