"""Check the packages' public types with pyright, as downstream users see them.

For each package, ``pyright --verifytypes <package> --ignoreexternal`` must
report a type completeness of 100 % (every public symbol with an explicit,
unambiguous type). Then pyright in strict mode checks
tools/consumer/typed_consumer.py, copied to a folder outside the source tree.

The packages are looked up in the environment of ``--python`` (default: the
running interpreter). pyright must be installed in the running interpreter
(``pip install pyright==1.1.414``). Prints one line per check; exits 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final, TypedDict

ROOT: Final = Path(__file__).resolve().parent.parent
CONSUMER: Final = ROOT / "tools" / "consumer" / "typed_consumer.py"
PACKAGES: Final = ("join_core", "ddp_join", "rpc_registry", "tensorpipe_backend", "lightning_join")
PYRIGHT: Final = "pyright==1.1.414"


class _Position(TypedDict):
    line: int
    character: int


class _Range(TypedDict):
    start: _Position


class _Diagnostic(TypedDict, total=False):
    file: str
    severity: str
    message: str
    rule: str
    range: _Range


def _pyright(args: Sequence[str], python: Path, cwd: Path) -> dict[str, object]:
    """Run pyright with JSON output against the environment of ``python``.

    ``--verifytypes`` ignores ``--pythonpath`` and resolves imports with the
    first ``python`` on PATH, so that interpreter's folder leads PATH too.
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(python.parent), env.get("PATH", "")])
    cmd = [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", str(python), *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    try:
        result: dict[str, object] = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(
            f"pyright {' '.join(args)} exited {done.returncode} without a JSON report:\n"
            f"{done.stdout}{done.stderr}"
        ) from None
    return result


def _diagnostics(raw: object, shown_as: tuple[str, str] = ("", "")) -> list[str]:
    """pyright's errors and warnings as ``file:line:col: message`` lines, with the
    file name's prefix ``shown_as[0]`` replaced by ``shown_as[1]``."""
    assert isinstance(raw, list)
    lines: list[str] = []
    for item in raw:
        diag: _Diagnostic = item
        if diag.get("severity") not in ("error", "warning"):
            continue
        start = diag["range"]["start"] if "range" in diag else _Position(line=-1, character=-1)
        rule = f" ({diag['rule']})" if "rule" in diag else ""
        file = diag.get("file", "")
        if shown_as[0] and file.startswith(shown_as[0]):
            file = shown_as[1] + file[len(shown_as[0]) :]
        message = diag.get("message", "").replace("\n", "\n      ")
        where = f"{file}:{start['line'] + 1}:{start['character'] + 1}: " if file else ""
        lines.append(f"    {where}{diag.get('severity')}: {message}{rule}")
    return lines


def verify_types(package: str, python: Path) -> bool:
    """``pyright --verifytypes``: whether ``package`` is 100 % type complete; prints one line."""
    with tempfile.TemporaryDirectory() as outside:
        report = _pyright(["--verifytypes", package, "--ignoreexternal"], python, Path(outside))
    completeness = report.get("typeCompleteness")
    assert isinstance(completeness, dict)
    score = float(completeness.get("completenessScore", 0.0))
    found = bool(completeness.get("packageRootDirectory"))
    ok = found and score >= 1.0
    where = completeness.get("packageRootDirectory") or f"not found in the environment of {python}"
    print(f"pyright --verifytypes {package}: {score:.1%} ({'ok' if ok else 'FAILED'}; {where})", flush=True)
    if not ok:
        symbols = completeness.get("symbols", [])
        assert isinstance(symbols, list)
        problems = [line for symbol in symbols for line in _diagnostics(symbol.get("diagnostics", []))]
        print("\n".join(problems + _diagnostics(report.get("generalDiagnostics", []))), flush=True)
    return ok


def check_consumer(python: Path) -> bool:
    """pyright in strict mode on the consumer file; whether it is clean; prints one line."""
    with tempfile.TemporaryDirectory() as outside:
        folder = Path(outside)
        shutil.copy(CONSUMER, folder / CONSUMER.name)
        config = {
            "typeCheckingMode": "strict",
            "include": [CONSUMER.name],
            "reportUnnecessaryTypeIgnoreComment": "error",
        }
        (folder / "pyrightconfig.json").write_text(json.dumps(config))
        report = _pyright(["--project", str(folder / "pyrightconfig.json")], python, folder)
    shown_as = (str(folder / CONSUMER.name), str(CONSUMER.relative_to(ROOT)))
    problems = _diagnostics(report.get("generalDiagnostics", []), shown_as)
    ok = not problems
    status = "ok" if ok else f"FAILED, {len(problems)} errors or warnings"
    print(f"pyright strict {CONSUMER.relative_to(ROOT)}: {status}", flush=True)
    if not ok:
        print("\n".join(problems), flush=True)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--python",
        type=Path,
        default=Path(sys.executable),
        help="interpreter whose environment holds the packages (default: this one)",
    )
    args = parser.parse_args(argv)
    python: Path = args.python
    if importlib.util.find_spec("pyright") is None:
        print(
            f"pyright is not installed for {sys.executable}: run `{sys.executable} -m pip install {PYRIGHT}`"
        )
        return 2
    if not python.exists():
        print(f"--python {python}: no such interpreter; pass the python of the environment to check")
        return 2
    results = [verify_types(package, python) for package in PACKAGES]
    results.append(check_consumer(python))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
