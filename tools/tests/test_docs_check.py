"""tools/docs_check.py finds every Python example and fails on a broken one."""

from __future__ import annotations

from pathlib import Path

import api_reference
import dev
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


def _site(tmp_path: Path, drop: str, add: str) -> Path:
    """A built site whose reference pages show every public name but ``drop``, and ``add``."""
    for dist in dev.packages():
        names = api_reference.public_names(dist)
        anchors = [m for m in names if "." in m] + [f"{m}.{n}" for m, found in names.items() for n in found]
        anchors += [f"{m}.Member.method" for m in names]  # members of names are not names
        if dist == "join-core":
            anchors = [a for a in anchors if a != drop] + [add]
        page = tmp_path / "api" / dist / "index.html"
        page.parent.mkdir(parents=True)
        page.write_text("".join(f'<h2 id="{a}">{a}</h2>\n' for a in anchors))
    return tmp_path


def test_the_reference_must_show_every_public_name_and_no_other(tmp_path: Path) -> None:
    assert docs_check.reference_problems(_site(tmp_path / "ok", "", "join_core.Join")) == []
    assert docs_check.reference_problems(_site(tmp_path / "bad", "join_core.Join", "join_core.join")) == [
        "docs/api/join-core.md: public name join_core.Join is missing",
        "docs/api/join-core.md: join_core.join is documented but not in its module's __all__",
    ]


def test_the_built_reference_has_every_public_name_of_every_package() -> None:
    pages = {dist: api_reference.markdown(dist) for dist in ("join-core", "rpc-registry")}
    assert "::: join_core.testing" in pages["join-core"] and "run_ranks" in pages["join-core"]
    for module in ("rpc_registry.autograd", "rpc_registry.optim", "rpc_registry.nn"):
        assert f"::: {module}\n" in pages["rpc-registry"]
    assert '<h3 id="rpc_registry.dist_autograd">' in pages["rpc-registry"]


def test_a_page_mentioning_a_name_the_code_lacks_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Use `rpc_registry.optim.DistributedOptimizer`, `join_core.Join.is_active` and\n"
        "`rpc_registry.autograd`, not `rpc_registry.no_such` or `ddp_join.zero.Missing`.\n"
    )
    problems = docs_check.mention_problems([page])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "`rpc_registry.no_such` is no public name of ours",
        "`ddp_join.zero.Missing` is no public name of ours",
    ]


def test_the_list_of_torch_names_not_provided_must_match_the_code(tmp_path: Path) -> None:
    page = tmp_path / "moving.md"
    page.write_text(
        "<!-- not provided: torch.distributed.rpc -->\n"
        "- `server_process_global_profiler`: no.\n- `remote`: no.\n"
        "<!-- /not provided -->\n"
    )
    problems = [
        p.split(": ", 1)[1]
        for p in docs_check.not_provided_problems(page, {"server_process_global_profiler", "internal"})
    ]
    assert problems == [
        "torch.distributed.rpc.internal is not provided, and the list does not say why",
        "remote is listed as not provided, but rpc_registry.remote exists",
    ]
    real = docs_check.ROOT / "docs" / "moving-from-torch.md"
    assert docs_check.not_provided_problems(real, docs_check.torch_rpc_left_out()) == []
