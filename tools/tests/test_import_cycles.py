"""tools/import_cycles.py finds modules of a package that import one another."""

from __future__ import annotations

from pathlib import Path

import import_cycles
import pytest


def _package(tmp_path: Path, modules: dict[str, str]) -> Path:
    source = tmp_path / "pkg"
    source.mkdir()
    (source / "__init__.py").write_text("from . import a\n")
    for name, text in modules.items():
        (source / f"{name}.py").write_text(text)
    return source


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    source = _package(
        tmp_path,
        {
            "a": "from . import b\n",
            "b": "from pkg.c import x\n",
            "c": "def f():\n    from .a import y\n",
            "d": "import pkg.a\n",
        },
    )
    graph = import_cycles.import_graph(source)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles.cycles(graph) == [["a", "b", "c"]]


def test_imports_in_one_direction_are_no_cycle(tmp_path: Path) -> None:
    source = _package(
        tmp_path, {"a": "from .b import x\nfrom . import c\n", "b": "from .c import y\n", "c": ""}
    )
    assert import_cycles.cycles(import_cycles.import_graph(source)) == []


@pytest.mark.parametrize("package", list(import_cycles.package_sources()))
def test_the_modules_of_a_package_import_one_another_without_a_cycle(package: str) -> None:
    source = import_cycles.package_sources()[package]
    assert import_cycles.cycles(import_cycles.import_graph(source)) == []
