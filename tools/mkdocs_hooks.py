"""MkDocs hooks: pages that show what lives beside the code, so it is written once.

- The Benchmarks page takes the tables from bench/results.md and
  bench/results-peers.md (a marker ``<!-- bench/results.md -->`` is replaced
  by that file) and the plots beside them, written by bench/run.py.
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
MARKER = re.compile(r"<!-- bench/(results[\w-]*\.md) -->")
API = re.compile(r"<!-- api: (\S+) -->")
SECURITY = re.compile(r"<!-- security: (\S+) -->\n.*?<!-- /security -->\n", re.DOTALL)


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Add the plots of bench/ to the site under the same paths."""
    for plot in sorted(BENCH.glob("results*.png")):
        path = f"bench/{plot.name}"
        files.append(File(path, str(ROOT), config["site_dir"], use_directory_urls=False))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files, **kwargs: Any) -> str:
    """Put bench/results.md and the README's Security section where a page asks for them."""
    markdown = API.sub(lambda found: api_reference.markdown(found.group(1)), markdown)
    markdown = MARKER.sub(lambda found: (BENCH / found.group(1)).read_text(), markdown)
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
