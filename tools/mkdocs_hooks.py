"""MkDocs hooks: the benchmark results live in bench/, written by tools/bench.py.

The Benchmarks page takes the table from bench/results.md (the marker
``<!-- bench/results.md -->`` is replaced by it) and the plot from
bench/results.png, so the docs always show the latest committed run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
MARKER = "<!-- bench/results.md -->"


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Add bench/results.png to the site as bench/results.png."""
    files.append(File("bench/results.png", str(ROOT), config["site_dir"], use_directory_urls=False))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files, **kwargs: Any) -> str:
    """Put bench/results.md where the Benchmarks page has its marker."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, (BENCH / "results.md").read_text())
