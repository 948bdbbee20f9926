"""A package's version and the notes of one release, from its CHANGELOG.md.

    python tools/release_notes.py ddp-join 0.2.0   # prints that version's section

The release workflow runs it for the pushed tag (``ddp-join-v0.2.0``): it
fails unless the package's ``__version__`` (the one its build declares) is
that version and its CHANGELOG.md (Keep a Changelog) has a section for it,
and the printed section becomes the text of the GitHub release.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def version_of(package: Path) -> str:
    """The ``__version__`` of a package folder (``packages/<dist-name>``), which its build uses."""
    init = package / "src" / package.name.replace("-", "_") / "__init__.py"
    found = re.search(r'^__version__ = "([^"]+)"$', init.read_text(), re.MULTILINE)
    if found is None:
        raise ValueError(f'{_shown(init)}: no __version__ = "..." line')
    return found.group(1)


def notes(package: Path, version: str) -> str:
    """The body of the ``## [version] - date`` section of the package's CHANGELOG.md."""
    changelog = package / "CHANGELOG.md"
    text = changelog.read_text()
    found = re.search(
        rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}\n(.*?)(?=^## |^\[[^\]]+\]: |\Z)",
        text,
        re.MULTILINE | re.DOTALL,
    )
    if found is None or not found.group(1).strip():
        raise ValueError(
            f"{_shown(changelog)}: no section '## [{version}] - YYYY-MM-DD' with its changes; "
            "move the entries under [Unreleased] into one"
        )
    return found.group(1).strip() + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    name, version = argv
    package = ROOT / "packages" / name
    if not (package / "pyproject.toml").is_file():
        print(f"release_notes: no package packages/{name}", file=sys.stderr)
        return 1
    try:
        declared = version_of(package)
        if declared != version:
            raise ValueError(
                f"packages/{name} is version {declared} (__version__), not {version}: "
                f"tag {name}-v{declared}, or set __version__ and add its CHANGELOG section"
            )
        sys.stdout.write(notes(package, version))
    except ValueError as error:
        print(f"release_notes: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
