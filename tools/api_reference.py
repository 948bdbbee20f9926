"""The public names of every package, read from the sources' ``__all__``.

The API reference pages are generated from this (tools/mkdocs_hooks.py), and
the docs check compares the built pages with it (tools/docs_check.py): the
reference is complete by construction, and a page that documents a name the
code does not export, or misses one it does, fails the check.

Public, as type checkers count it (``pyright --verifytypes``): every name in
the ``__all__`` of the package and of each module whose name has no leading
underscore. A module's names that the package already exports are shown once,
under the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"


def package_source(dist: str) -> Path:
    """The import package folder of a distribution folder name (``join-core`` -> .../join_core)."""
    return PACKAGES / dist / "src" / dist.replace("-", "_")


def declared_all(module: Path) -> list[str]:
    """The names in a module's ``__all__`` (a list or tuple of string literals)."""
    tree = ast.parse(module.read_text(), str(module))
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [str(name) for name in ast.literal_eval(value)]
    return []


def public_names(dist: str) -> dict[str, list[str]]:
    """Module -> the public names it documents: the package's ``__all__`` first, then each
    public module's names the package does not export (modules with none left out)."""
    source = package_source(dist)
    package = source.name
    top = declared_all(source / "__init__.py")
    found = {package: top}
    for module in sorted(source.glob("*.py")):
        if module.name.startswith("_"):
            continue
        rest = [name for name in declared_all(module) if name not in top]
        if rest:
            found[f"{package}.{module.stem}"] = rest
    return found


def imported_elsewhere(dist: str) -> dict[str, str]:
    """Names of the package's ``__all__`` that are not its own objects, with what they are:
    its modules under another name (``dist_autograd``) and classes of other
    distributions (torch's ``Store``), which the reference names without rendering."""
    source = package_source(dist)
    package = source.name
    found = {}
    for node in ast.parse((source / "__init__.py").read_text()).body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            name = alias.asname or alias.name
            if node.level == 1 and node.module is None:
                found[name] = f"the module `{package}.{alias.name}`"
            elif node.level == 0 and node.module is not None and not node.module.startswith(package):
                found[name] = f"`{node.module}.{alias.name}`, re-exported"
    top = set(declared_all(source / "__init__.py"))
    return {name: what for name, what in found.items() if name in top}


def markdown(dist: str) -> str:
    """The mkdocstrings directives of one package's reference page."""
    parts = []
    elsewhere = imported_elsewhere(dist)
    for module, names in public_names(dist).items():
        rendered = [name for name in names if name not in elsewhere or "." in module]
        heading = "" if "." not in module else f"## `{module}`\n\n"
        parts.append(
            f"{heading}::: {module}\n    options:\n      members: [{', '.join(rendered)}]\n"
            "      show_submodules: false\n"
        )
        if "." not in module:
            parts += [
                f'<h3 id="{module}.{name}"><code>{module}.{name}</code></h3>\n\n{what}.\n'
                for name, what in elsewhere.items()
            ]
    return "\n".join(parts)
