"""tools/release_notes.py: a release is the version the package declares, with its CHANGELOG section."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dev
import package_check
import pytest
import release_notes

CHANGELOG = """\
# Changelog

## [Unreleased]

## [0.2.0] - 2026-11-24

### Added
- a thing

## [0.1.0] - 2026-11-22

### Added
- the first thing

[Unreleased]: https://example.org/compare/p-v0.2.0...HEAD
[0.2.0]: https://example.org/compare/p-v0.1.0...p-v0.2.0
"""


def _package(tmp_path: Path, version: str, changelog: str = CHANGELOG) -> Path:
    package = tmp_path / "p-kg"
    (package / "src" / "p_kg").mkdir(parents=True, exist_ok=True)
    (package / "src" / "p_kg" / "__init__.py").write_text(f'"""p."""\n\n__version__ = "{version}"\n')
    (package / "CHANGELOG.md").write_text(changelog)
    return package


def test_the_notes_are_the_section_of_that_version(tmp_path: Path) -> None:
    package = _package(tmp_path, "0.2.0")
    assert release_notes.version_of(package) == "0.2.0"
    assert release_notes.notes(package, "0.2.0") == "### Added\n- a thing\n"
    assert release_notes.notes(package, "0.1.0") == "### Added\n- the first thing\n"


def test_a_version_without_a_section_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no section '## \[0\.3\.0\] - YYYY-MM-DD'.*under \[Unreleased\]"):
        release_notes.notes(_package(tmp_path, "0.3.0"), "0.3.0")
    wheel = tmp_path / "p_kg-0.3.0-py3-none-any.whl"
    [problem] = package_check.changelog_problems(_package(tmp_path, "0.3.0"), [wheel])
    assert problem.startswith("p_kg-0.3.0-py3-none-any.whl: ")


def test_every_package_has_a_version_and_its_changelog_section() -> None:
    for name in dev.packages():
        package = dev.PACKAGES / name
        version = release_notes.version_of(package)
        # 0.2.0 for the packages released before; lightning-join's first release is 0.1.0.
        assert version == ("0.1.0" if name == "lightning-join" else "0.2.0")
        assert "### " in release_notes.notes(package, version)
        module = name.replace("-", "_")
        assert f'path = "src/{module}/__init__.py"' in (package / "pyproject.toml").read_text()


def test_a_tag_of_another_version_than_the_package_declares_is_refused() -> None:
    result = subprocess.run(
        [sys.executable, "tools/release_notes.py", "ddp-join", "9.9.9"],
        cwd=dev.ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "packages/ddp-join is version 0.2.0 (__version__), not 9.9.9: tag ddp-join-v0.2.0" in result.stderr
    ok = subprocess.run(
        [sys.executable, "tools/release_notes.py", "ddp-join", "0.2.0"],
        cwd=dev.ROOT,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("### Added")


def test_the_release_workflow_publishes_with_those_notes() -> None:
    workflow = (dev.ROOT / ".github" / "workflows" / "release.yml").read_text()
    assert 'python tools/release_notes.py "$package" "$version"' in workflow
    assert "--notes-file" in workflow
