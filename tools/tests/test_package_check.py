"""tools/package_check.py finds what must not reach PyPI."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import package_check


def _sdist(path: Path, names: list[str]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            archive.addfile(info, io.BytesIO(b"x"))
    return path


def test_sdist_leftovers_are_reported(tmp_path: Path) -> None:
    sdist = _sdist(
        tmp_path / "p-0.1.0.tar.gz",
        [
            "p-0.1.0/src/p/__init__.py",
            "p-0.1.0/tests/.hypothesis/examples/abc",
            "p-0.1.0/src/p/__pycache__/x.cpython-311.pyc",
            "p-0.1.0/hypothesis_notes.md",
        ],
    )
    problems = package_check.sdist_problems(sdist)
    assert len(problems) == 2
    assert any(".hypothesis/examples" in p for p in problems)
    assert any("__pycache__" in p for p in problems)


def test_relative_readme_links_are_reported(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(
        "[a](../join-core) [b](https://pypi.org/project/join-core/) [c](#usage) [d](docs/x.md)\n"
    )
    problems = package_check.readme_problems(tmp_path)
    assert [p.split("(")[1].split(")")[0] for p in problems] == ["../join-core", "docs/x.md"]


def test_released_readmes_have_only_absolute_links() -> None:
    for readme in sorted((package_check.ROOT / "packages").glob("*/README.md")):
        assert package_check.readme_problems(readme.parent) == []


def test_ci_runs_both_ends_of_the_torch_range_every_package_declares() -> None:
    declared = {
        p.parent.name: re.findall(r'"torch>=([\d.]+),<([\d.]+)"', p.read_text())
        for p in (package_check.ROOT / "packages").glob("*/pyproject.toml")
    }
    assert all(len(found) == 1 for found in declared.values()), declared
    [(lowest, below)] = {found[0] for found in declared.values()}
    ci = (package_check.ROOT / ".github" / "workflows" / "ci.yml").read_text()
    ends = dict(re.findall(r'- end: (\w+)\n\s+torch: "([\d.]+)"', ci))
    assert ends["lowest"] == f"{lowest}.0"
    # The bound is the minor release after the newest one tested.
    major, minor = map(int, ends["newest"].split(".")[:2])
    assert below == f"{major}.{minor + 1}"
