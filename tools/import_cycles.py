"""The import cycles among the modules of each package, read from the sources.

    python3 tools/import_cycles.py [PACKAGE...]   # default: every package; exits 1 on a cycle

Every import of a sibling module counts, wherever it is written: at the top,
inside a function, or under ``if TYPE_CHECKING:`` (a cycle a reader must
follow all the same). The package's ``__init__`` is left out: every module
imports it first, by Python's rules.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"


def package_sources() -> dict[str, Path]:
    """Each package's import name and source folder (``join_core`` -> .../src/join_core)."""
    found = {}
    for project in sorted(PACKAGES.glob("*/pyproject.toml")):
        name = project.parent.name.replace("-", "_")
        found[name] = project.parent / "src" / name
    return found


def _imported(node: ast.AST, package: str) -> list[str]:
    """The first dotted part below ``package`` of each name that an import statement imports."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] for a in node.names if a.name.startswith(f"{package}.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 1:
        module = node.module
    elif node.level == 0 and node.module is not None and node.module.split(".")[0] == package:
        module = node.module.partition(".")[2] or None
    else:
        return []
    if module is None:  # from . import a, b
        return [a.name for a in node.names]
    return [module.split(".")[0]]


def import_graph(source: Path) -> dict[str, set[str]]:
    """Which sibling modules each module of the package in ``source`` imports."""
    modules = {path.stem: path for path in source.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = {t for node in ast.walk(tree) for t in _imported(node, source.name)}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another (strongly connected, more than one), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def main(argv: list[str]) -> int:
    sources = package_sources()
    unknown = [name for name in argv if name not in sources]
    if unknown:
        print(f"import_cycles.py: unknown package {unknown[0]!r}; the packages are {', '.join(sources)}")
        return 2
    failed = False
    for name in argv or list(sources):
        graph = import_graph(sources[name])
        for group in cycles(graph):
            failed = True
            edges = "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(group)))}" for m in group)
            print(f"{name}: import cycle among {', '.join(group)} ({edges})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
