"""tools/docs_check.py finds every Python example and fails on a broken one."""

from __future__ import annotations

from pathlib import Path

import docs_check

ABORT = "terminate called without an active exception"

PAGE = """\
# Title

```python
print("plain")
```

```sh
echo not python
```

```python
# torchrun --nproc-per-node 2 example.py
import os
assert os.environ["WORLD_SIZE"] == "2"
```
"""


def test_examples_are_found_with_their_ranks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    found = docs_check.examples(page)
    assert [(e.line, e.ranks) for e in found] == [(4, 0), (12, 2)]
    assert found[0].code == 'print("plain")\n'


def test_a_failing_example_is_reported(tmp_path: Path) -> None:
    broken = docs_check.Example(tmp_path / "x.md", 1, "raise SystemExit(3)\n", 0)
    assert docs_check.run(broken) == "exited 3:\n"
    assert docs_check.run(docs_check.Example(tmp_path / "x.md", 1, "x = 1\n", 0)) is None


def test_a_failing_rank_is_reported(tmp_path: Path) -> None:
    code = "import os, sys\nsys.exit(int(os.environ['RANK']) * 4)\n"
    problem = docs_check.run(docs_check.Example(tmp_path / "x.md", 1, code, 2))
    assert problem is not None and problem.startswith("rank 1 exited 4")


def test_the_readmes_and_docs_have_examples() -> None:
    sources = docs_check.sources()
    assert docs_check.ROOT / "packages" / "tensorpipe-backend" / "README.md" in sources
    assert sum(len(docs_check.examples(s)) for s in sources) >= 6


def test_the_security_page_shows_the_readme_section_when_there_is_one() -> None:
    import mkdocs_hooks

    readme = "# pkg\n\nintro\n\n## Security\n\n**Threat model.** text\n\nmore\n\n## Tests\n\nrun\n"
    assert mkdocs_hooks.readme_section(readme, "Security") == "**Threat model.** text\n\nmore\n"
    assert mkdocs_hooks.readme_section("# pkg\n\n## Tests\n", "Security") is None
    assert mkdocs_hooks.readme_section("## Security\nlast\n", "Security") == "last\n"


def test_an_example_that_aborts_after_its_last_line_fails(tmp_path: Path) -> None:
    code = f"# torchrun --nproc-per-node 1 x.py\nimport os\nprint({ABORT!r}, flush=True)\nos.abort()\n"
    problem = docs_check.run(docs_check.Example(tmp_path / "x.md", 1, code, 1))
    assert problem is not None and ABORT in problem


def test_the_benchmarks_page_shows_every_results_table_it_names() -> None:
    import mkdocs_hooks
    from mkdocs.structure.files import Files

    page = "ours:\n<!-- bench/results.md -->\npeers:\n<!-- bench/results-peers.md -->\n"
    shown = mkdocs_hooks.on_page_markdown(page, page=None, config={}, files=Files([]))
    bench = mkdocs_hooks.BENCH
    expected = (
        f"ours:\n{(bench / 'results.md').read_text()}\npeers:\n{(bench / 'results-peers.md').read_text()}\n"
    )
    assert shown == expected
