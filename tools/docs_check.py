"""Build the documentation with warnings as errors, check the API reference and
the names the pages mention against the code, and run every Python example.

The API reference (docs/api/, generated from the packages' ``__all__``,
tools/api_reference.py) must show every public name and no other; a
```pkg.name``` that a page or README mentions must be a public name or
module of ours.

The examples are the ```python blocks of README.md, packages/*/README.md and
docs/**/*.md. A block whose first lines name ``torchrun --nproc-per-node N``
runs on N local ranks with torchrun's environment (integration_tests/launch.py);
any other block runs once as a script. Each runs from an empty folder and
must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import sybil
from sybil.parsers.markdown import CodeBlockParser

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "integration_tests"))

import api_reference  # noqa: E402
from launch import launch  # noqa: E402

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


def example_of(source: Path, line: int, code: str) -> Example:
    """A code block, with the number of ranks its first lines ask for."""
    ranks = RANKS.search("\n".join(code.splitlines()[:3]))
    return Example(source, line, code, int(ranks.group(1)) if ranks else 0)


def evaluate(example: sybil.Example) -> str | None:
    """sybil's evaluator: run one block (see :func:`run`); what went wrong, or None."""
    return run(example_of(Path(example.path), example.line + 1, str(example.parsed)))


#: The ```python blocks of Markdown files, found by sybil; run as pytest items
#: through the plugin tools/docs_examples.py.
SYBIL: Final = sybil.Sybil(
    parsers=[CodeBlockParser(language="python", evaluator=evaluate)], patterns=["*.md"], path=str(ROOT)
)


def examples(path: Path) -> list[Example]:
    """The ```python blocks of one Markdown file."""
    return [example_of(path, e.line + 1, str(e.parsed)) for e in SYBIL.parse(path)]


def sources() -> list[Path]:
    """Every Markdown file whose examples must run."""
    return [
        ROOT / "README.md",
        *sorted((ROOT / "packages").glob("*/README.md")),
        *sorted((ROOT / "docs").rglob("*.md")),
    ]


SITE = ROOT / ".cache" / "site"


def _where(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


# Our import names, from the package folders.
_OURS = "|".join(
    sorted(p.parent.name.replace("-", "_") for p in (ROOT / "packages").glob("*/pyproject.toml"))
)
ANCHOR = re.compile(rf'id="((?:{_OURS})(?:\.\w+)+)"')
MENTION = re.compile(rf"`((?:{_OURS})(?:\.\w+)+)")


def reference_problems(site: Path) -> list[str]:
    """What the built API reference shows that ``__all__`` does not say, and the reverse."""
    problems = []
    for dist in sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")):
        page = site / "api" / dist / "index.html"
        names = api_reference.public_names(dist)
        expected = {f"{module}.{name}" for module, found in names.items() for name in found}
        if not page.is_file():
            problems.append(f"docs/api/{dist}.md: no page built; it lists the {len(expected)} public names")
            continue
        anchors = ANCHOR.findall(page.read_text())
        shown = {anchor for anchor in anchors if anchor in expected}  # a module shown on its own, too
        for anchor in anchors:
            module = max((m for m in names if anchor.startswith(m + ".")), key=len, default=None)
            # A name of that module: not a documented module itself, nor a member of a name.
            if module is not None and anchor not in names and "." not in anchor[len(module) + 1 :]:
                shown.add(anchor)
        problems += [f"docs/api/{dist}.md: public name {n} is missing" for n in sorted(expected - shown)]
        problems += [
            f"docs/api/{dist}.md: {n} is documented but not in its module's __all__"
            for n in sorted(shown - expected)
        ]
    return problems


def mention_problems(pages: list[Path]) -> list[str]:
    """Names of ours that pages mention in code spans (```rpc_registry.optim```) but the code lacks."""
    modules: set[str] = set()
    names = {"rpc_registry.backends"}  # the entry-point group's name
    for dist in (p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml")):
        source = api_reference.package_source(dist)
        modules |= {
            source.name,
            *(f"{source.name}.{m.stem}" for m in source.glob("*.py") if m.stem != "__init__"),
        }
        names.add(f"{source.name}.__version__")
        for module in sorted(modules):
            if module.startswith(source.name + "."):
                file = source / f"{module.split('.')[1]}.py"
                names |= {f"{module}.{name}" for name in api_reference.declared_all(file)}
        names |= {f"{source.name}.{name}" for name in api_reference.declared_all(source / "__init__.py")}
    problems = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for mention in MENTION.findall(line):
                owner = mention.rpartition(".")[0]
                # A module or name of ours, or an attribute of a name (a method), not of a module.
                if mention not in modules | names and owner not in names:
                    problems.append(f"{_where(page)}:{number}: `{mention}` is no public name of ours")
    return problems


NOT_PROVIDED = re.compile(
    r"<!-- not provided: torch\.distributed\.rpc -->\n(.*?)<!-- /not provided -->", re.DOTALL
)


def torch_rpc_left_out() -> set[str]:
    """torch.distributed.rpc's own public names (not its imports) that rpc_registry lacks."""
    import types

    import torch.distributed.rpc as torch_rpc

    import rpc_registry

    def torchs(name: str) -> bool:
        value = getattr(torch_rpc, name)
        where = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", "")
        return str(where).startswith(("torch.distributed.rpc", "torch._C._distributed_rpc"))

    public = [n for n in dir(torch_rpc) if not n.startswith("_") and torchs(n)]
    return {n for n in public if not hasattr(rpc_registry, n)}


def not_provided_problems(page: Path, left_out: set[str]) -> list[str]:
    """The migration page's list of torch's RPC names not provided, against the code."""
    block = NOT_PROVIDED.search(page.read_text())
    if block is None:
        return [f"{_where(page)}: no '<!-- not provided: torch.distributed.rpc -->' list"]
    listed = set(re.findall(r"`(\w+)`", block.group(1)))
    problems = [
        f"{_where(page)}: torch.distributed.rpc.{name} is not provided, and the list does not say why"
        for name in sorted(left_out - listed)
    ]
    import rpc_registry

    problems += [
        f"{_where(page)}: {name} is listed as not provided, but rpc_registry.{name} exists"
        for name in sorted(listed)
        if hasattr(rpc_registry, name) and name not in left_out
    ]
    return problems


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
    failures += reference_problems(SITE) + mention_problems(sources())
    failures += not_provided_problems(ROOT / "docs" / "moving-from-torch.md", torch_rpc_left_out())
    print("docs: every example (pytest, sybil)", flush=True)
    # private_tmp: the dumps of the ranks an example loses go with the run (tools/pytest_plugins)
    plugins = ["-p", "docs_examples", "-p", "private_tmp", "-p", "no:cacheprovider"]
    pytest = [sys.executable, "-m", "pytest", *plugins, "-v"]
    path = [str(ROOT / "tools"), str(ROOT / "tools" / "pytest_plugins"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    if subprocess.run([*pytest, *map(str, sources())], cwd=ROOT, env=env).returncode != 0:
        failures.append("an example failed (above)")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
