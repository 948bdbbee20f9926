"""Build the documentation with warnings as errors, and run every Python example.

The examples are the ```python blocks of README.md, packages/*/README.md and
docs/**/*.md. A block whose first lines name ``torchrun --nproc-per-node N``
runs on N local ranks with torchrun's environment (integration_tests/launch.py);
any other block runs once as a script. Each runs from an empty folder and
must exit 0.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "integration_tests"))

from launch import launch  # noqa: E402

FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
RANKS = re.compile(r"torchrun --nproc-per-node (\d+)")
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Example:
    """One code block: where it is, its code, and on how many ranks it runs (0: a plain script)."""

    source: Path
    line: int
    code: str
    ranks: int

    def __str__(self) -> str:
        where = self.source.relative_to(ROOT) if self.source.is_relative_to(ROOT) else self.source
        return f"{where}:{self.line}" + (f" ({self.ranks} ranks)" if self.ranks else "")


def examples(path: Path) -> list[Example]:
    """The ```python blocks of one Markdown file."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        code = match.group(1)
        head = "\n".join(code.splitlines()[:3])
        ranks = RANKS.search(head)
        line = text.count("\n", 0, match.start()) + 2
        found.append(Example(path, line, code, int(ranks.group(1)) if ranks else 0))
    return found


def sources() -> list[Path]:
    """Every Markdown file whose examples must run."""
    return [
        ROOT / "README.md",
        *sorted((ROOT / "packages").glob("*/README.md")),
        *sorted((ROOT / "docs").rglob("*.md")),
    ]


def run(example: Example) -> str | None:
    """Run one example; None if it passed, else what went wrong. Every rank
    must exit 0: an abort after the last line fails the example too."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "example.py"
        script.write_text(example.code)
        if example.ranks:
            exits = launch(script, example.ranks, timeout=TIMEOUT_S)
            failed = [e for e in exits if e.returncode != 0]
            return "\n".join(f"rank {e.rank} exited {e.returncode}:\n{e.output}" for e in failed) or None
        try:
            result = subprocess.run(
                [sys.executable, str(script)],
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return f"did not finish within {TIMEOUT_S:g} s"
        return None if result.returncode == 0 else f"exited {result.returncode}:\n{result.stdout}"


def main() -> int:
    print("docs: mkdocs build --strict", flush=True)
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"], cwd=ROOT)
    failures = [] if built.returncode == 0 else ["mkdocs build --strict failed (above)"]
    for example in [e for source in sources() for e in examples(source)]:
        print(f"example: {example}", flush=True)
        problem = run(example)
        if problem is not None:
            failures.append(f"{example}: {problem}")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
