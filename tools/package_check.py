"""Build every package as it would be released and check what would be uploaded.

For each package: an sdist, and a wheel built from that sdist (so a file the
sdist forgets fails here), into .cache/dist/<package>; then ``twine check
--strict`` on both, ``check-wheel-contents`` on the wheel, and checks of our
own: no build or test leftovers in the sdist (.hypothesis/, caches, bytecode),
the LICENSE beside the package equal to the repository's, only absolute
links in the README that PyPI shows, and a CHANGELOG.md section for the
version the wheel was built as (what the release workflow publishes).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import release_notes

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".cache" / "dist"
LEFTOVER = re.compile(
    r"(^|/)(\.hypothesis|__pycache__|\.pytest_cache|\.mypy_cache|\.ruff_cache|\.venv[^/]*)(/|$)|\.py[co]$"
)
RELATIVE_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)]+)\)")


def sdist_problems(sdist: Path) -> list[str]:
    """Leftovers (caches, bytecode, test databases) among an sdist's members."""
    with tarfile.open(sdist) as archive:
        return [f"{sdist.name}: leftover {m}" for m in archive.getnames() if LEFTOVER.search(m)]


def readme_problems(package: Path) -> list[str]:
    """Relative links in a README, which PyPI cannot follow."""
    text = (package / "README.md").read_text()
    return [
        f"{package.name}/README.md: relative link ({link}); PyPI needs an absolute URL"
        for link in RELATIVE_LINK.findall(text)
    ]


def changelog_problems(package: Path, wheels: list[Path]) -> list[str]:
    """A wheel built as a version its CHANGELOG.md says nothing of."""
    problems = []
    for wheel in wheels:
        version = wheel.name.split("-")[1]
        try:
            release_notes.notes(package, version)
        except (OSError, ValueError) as error:
            problems.append(f"{wheel.name}: {error}")
    return problems


def check(package: Path) -> list[str]:
    """Build one package and return what is wrong with it."""
    out = OUT / package.name
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        # --no-isolation: the build backend (hatchling) is in .venvs/torch, seen from here.
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(package)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    sdists, built = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    problems = (
        [f"{package.name}: built {len(sdists)} sdists and {len(built)} wheels, want one each"]
        if len(sdists) != 1 or len(built) != 1
        else []
    )
    for sdist in sdists:
        problems += sdist_problems(sdist)
    license_file = package / "LICENSE"
    if not license_file.is_file() or license_file.read_bytes() != (ROOT / "LICENSE").read_bytes():
        problems.append(f"{package.name}/LICENSE: missing or not equal to ./LICENSE; copy ./LICENSE there")
    problems += readme_problems(package)
    problems += changelog_problems(package, built)
    files = [str(f) for f in [*sdists, *built]]
    if subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files]).returncode != 0:
        problems.append(f"{package.name}: twine check --strict failed (above)")
    if subprocess.run([sys.executable, "-m", "check_wheel_contents", *map(str, built)]).returncode != 0:
        problems.append(f"{package.name}: check-wheel-contents failed (above)")
    return problems


def main() -> int:
    problems: list[str] = []
    for package in sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml")):
        print(f"package: {package.name}", flush=True)
        problems += check(package)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
