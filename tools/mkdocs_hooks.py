"""MkDocs hooks: pages that show what lives beside the code, so it is written once.

- The Benchmarks page takes the table from bench/results.md (the marker
  ``<!-- bench/results.md -->`` is replaced by it) and the plot from
  bench/results.png, written by tools/bench.py.
- An API reference page (``<!-- api: join-core -->``) lists every public
  name of that package, from tools/api_reference.py.
- The Security model page shows the "Security" section of
  packages/tensorpipe-backend/README.md, when it has one, in place of the
  text between ``<!-- security: ... -->`` and ``<!-- /security -->``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import api_reference

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
MARKER = "<!-- bench/results.md -->"
API = re.compile(r"<!-- api: (\S+) -->")
SECURITY = re.compile(r"<!-- security: (\S+) -->\n.*?<!-- /security -->\n", re.DOTALL)


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Add bench/results.png to the site as bench/results.png."""
    files.append(File("bench/results.png", str(ROOT), config["site_dir"], use_directory_urls=False))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files, **kwargs: Any) -> str:
    """Put bench/results.md and the README's Security section where a page asks for them."""
    markdown = API.sub(lambda found: api_reference.markdown(found.group(1)), markdown)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, (BENCH / "results.md").read_text())
    match = SECURITY.search(markdown)
    if match is not None:
        section = readme_section((ROOT / match.group(1)).read_text(), "Security")
        if section is not None:
            markdown = markdown[: match.start()] + section + markdown[match.end() :]
    return markdown


def readme_section(readme: str, title: str) -> str | None:
    """The body of a README's ``## title`` section (up to the next ``## ``), or None."""
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL)
    return found.group(1).strip() + "\n" if found else None
