"""tools/dev.py: environments follow declared dependencies; the summary counts what ran and what did not."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import dev
import pytest

PYTEST_OUTPUT = """\
tests/test_a.py ..s.
=========================== short test summary info ============================
SKIPPED [2] tests/test_a.py:12: needs 2 CUDA devices
SKIPPED [1] tests/test_b.py:40: needs NCCL
============= 1 failed, 7 passed, 3 skipped, 1 error in 4.20s =============
"""


def test_unit_environment_holds_the_package_and_the_siblings_it_declares() -> None:
    assert dev.siblings("join-core") == ["join-core"]
    assert dev.siblings("ddp-join") == ["ddp-join", "join-core"]
    assert dev.siblings("tensorpipe-backend") == ["join-core", "rpc-registry", "tensorpipe-backend"]
    envs = dev.environments()
    assert envs["unit-ddp-join"].editable == ("ddp-join", "join-core")
    assert all(e.over[:1] == ("torch",) for name, e in envs.items() if name != "torch")


def test_environments_over_one_base_are_made_side_by_side_after_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    envs = {
        "base": dev.Env("base", (), ()),
        "a": dev.Env("a", ("base",), ()),
        "b": dev.Env("b", ("base",), ()),
    }
    made: list[tuple[str, float, float]] = []

    def make(env: dev.Env, known: dict[str, dev.Env]) -> Path:
        if any(name == env.name for name, _, _ in made):
            return tmp_path / env.name  # up to date, as its stamp would say
        start = time.monotonic()
        time.sleep(0.5)
        made.append((env.name, start, time.monotonic()))
        return tmp_path / env.name

    monkeypatch.setattr(dev, "environments", lambda: envs)
    monkeypatch.setattr(dev, "_make", make)
    dev.ensure_all(["a", "b"])
    spans = {name: (start, end) for name, start, end in made}
    assert sorted(name for name, _, _ in made) == ["a", "b", "base"]  # the base once
    assert min(spans["a"][0], spans["b"][0]) >= spans["base"][1]
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1]  # a and b overlap


def test_a_base_environment_that_fails_is_told_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    envs = {
        "base": dev.Env("base", (), ()),
        "a": dev.Env("a", ("base",), ()),
        "b": dev.Env("b", ("base",), ()),
    }
    tries: list[str] = []

    def make(env: dev.Env, known: dict[str, dev.Env]) -> Path:
        tries.append(env.name)
        raise dev.EnvSetupError(f"[env] {env.name}: pip install failed", "pip said no")

    monkeypatch.setattr(dev, "environments", lambda: envs)
    monkeypatch.setattr(dev, "_make", make)
    with pytest.raises(SystemExit, match="base: pip install failed"):
        dev.ensure_all(["a", "b"])
    assert tries == ["base"]
    assert capsys.readouterr().out.count("pip said no") == 1


def test_any_error_making_an_environment_on_a_thread_reaches_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    envs = {"base": dev.Env("base", (), ()), "a": dev.Env("a", ("base",), ())}

    def make(env: dev.Env, known: dict[str, dev.Env]) -> Path:
        if env.name == "a":
            raise OSError("no space left on device")
        return Path(env.name)

    monkeypatch.setattr(dev, "environments", lambda: envs)
    monkeypatch.setattr(dev, "_make", make)
    with pytest.raises(OSError, match="no space left"):
        dev.ensure_all(["a"])


def test_tally_sums_counts_and_keeps_skip_reasons() -> None:
    tally = dev.Tally()
    tally.add(PYTEST_OUTPUT)
    tally.add(PYTEST_OUTPUT)
    assert (tally.passed, tally.failed, tally.skipped) == (14, 4, 6)
    assert tally.reasons == {"needs 2 CUDA devices": 4, "needs NCCL": 2}


def test_workflow_lint_without_node_is_skipped_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no node here
    assert dev.test(["workflows"]) == 0
    out = capsys.readouterr().out
    assert "skipped: node not found on PATH (install Node.js" in out
    assert "FAILED" not in out


def test_test_names_an_unknown_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert dev.test(["no such step"]) == 2
    assert "no step's title contains 'no such step'" in capsys.readouterr().out


def test_every_package_has_its_unit_test_step() -> None:
    titles = [s.title for s in dev.steps()]
    for package in dev.packages():
        assert f"unit tests: {package}" in titles
    assert os.path.isdir(dev.ROOT / "tools" / "tests")


def test_test_suites_and_other_checks_run_side_by_side(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = dev.Step("a suite", None, ("sleep", "2"), pytest=True)
    check = dev.Step("a check", None, ("sleep", "2"))
    monkeypatch.setattr(dev, "steps", lambda: [suite, check])
    start = time.monotonic()
    assert dev.test([]) == 0
    assert time.monotonic() - start < 3.5
    start = time.monotonic()
    assert dev.test(["--serial"]) == 0
    assert time.monotonic() - start >= 4
    out = capsys.readouterr().out
    assert "a suite" in out and "a check" in out


def test_dev_torch_pins_that_torch_in_environments_of_their_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(dev, "TORCH", "2.8.0")
    monkeypatch.setattr(dev, "VENVS", tmp_path / "torch-2.8.0")
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    constraints = Path(dev._env()["PIP_CONSTRAINT"])
    assert constraints.parent == tmp_path / "torch-2.8.0"
    pins = [line for line in constraints.read_text().splitlines() if line.split("==")[0] == "torch"]
    assert pins == ["torch==2.8.0"]
    assert dev.environments()["torch"].path == tmp_path / "torch-2.8.0" / "torch"


def test_dev_torch_that_is_not_a_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "TORCH", "latest")
    with pytest.raises(SystemExit, match="DEV_TORCH='latest': expected a torch version"):
        dev._env()


def test_every_lane_named_is_a_step_and_each_lane_has_steps() -> None:
    steps = dev.steps()
    assert set(dev.LANE_OF) <= {step.title for step in steps}
    lanes = {dev.lane_of(step) for step in steps}
    assert lanes == {"suites", "checks", "runs"}, lanes


PROGRESS = """\
============================= test session starts ==============================
collected 7 items

tests/test_a.py ..s.F                                                    [ 71%]
tests/test_b.py .E                                                       [100%]
=================================== FAILURES ===================================
E   assert 1 == 2
tests/test_a.py:12: AssertionError
"""


def test_pytest_progress_is_counted_as_it_comes() -> None:
    count = dev.PytestCount()
    cut = PROGRESS.index("s.F")
    for ch in PROGRESS[:cut]:  # pytest writes a character per test
        count.feed(ch)
    assert (count.total, count.done, count.failed, str(count)) == (7, 2, 0, "2/7 tests")
    count.feed(PROGRESS[cut:])
    assert (count.done, count.failed, str(count)) == (7, 2, "7/7 tests, 2 failed")


def test_the_summary_gives_each_steps_cpu_time_and_the_cores_kept_busy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A step whose child burns about 1 s of CPU, and one that sleeps.
    burn = dev.Step(
        "a burner",
        None,
        (
            "sh",
            "-c",
            "python3 -c 'import time; t = time.process_time()\nwhile time.process_time() - t < 1: pass'",
        ),
    )
    sleep = dev.Step("a sleeper", None, ("sleep", "1"))
    monkeypatch.setattr(dev, "steps", lambda: [burn, sleep])
    assert dev.test([]) == 0
    lines = capsys.readouterr().out.splitlines()
    burned = float(next(x for x in lines if x.startswith("a burner ")).split()[-3])
    slept = float(next(x for x in lines if x.startswith("a sleeper ")).split()[-3])
    assert burned >= 0.9 and slept < 0.5, lines
    assert any(x.startswith("in ") and "s of CPU (" in x and "cores busy on average)" in x for x in lines), (
        lines
    )


def test_each_steps_output_is_under_its_own_header_with_progress_lines_when_piped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    slow = dev.Step(
        "a suite",
        None,
        ("sh", "-c", "echo collected 2 items; echo; printf 't.py .'; sleep 2; echo .; echo from-suite"),
        pytest=True,
    )
    fast = dev.Step("a check", None, ("sh", "-c", "sleep 0.5; echo from-check"))
    monkeypatch.setattr(dev, "steps", lambda: [slow, fast])
    monkeypatch.setattr(dev, "PROGRESS_EVERY_S", 0.3)
    assert dev.test([]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    lines = out.splitlines()
    for title, printed in (("a suite", "from-suite"), ("a check", "from-check")):
        header = lines.index(f"===== {title} =====")
        assert lines[header + 1].startswith("$ sh -c")
        assert (
            printed
            in lines[header + 2 : lines.index(next(x for x in lines if x.startswith(f"[done] {title}:")))]
        )
    progress = [x for x in lines if x.startswith("[progress] running: ")]
    assert any("a suite (" in x and "1/2 tests" in x for x in progress), progress


def test_help_is_printed_with_success(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["-h"], ["test", "--help"]):
        assert dev.main(argv) == 0
        assert "python3 tools/dev.py test [STEP...]" in capsys.readouterr().out
    assert dev.main(["tset"]) == 2
    assert "unknown command 'tset'" in capsys.readouterr().out


def test_no_terminal_codes_reach_a_pipe_even_when_a_tool_is_told_to_color() -> None:
    result = subprocess.run(
        [sys.executable, "tools/dev.py", "test", "lint (ruff"],
        cwd=dev.ROOT,
        env=dict(os.environ, FORCE_COLOR="1", CLICOLOR_FORCE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All checks passed!" in result.stdout
    assert "\x1b" not in result.stdout + result.stderr


def test_docs_serve_rebuilds_when_a_packages_source_changes() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "tools/dev.py", "docs", "-a", f"127.0.0.1:{port}"],
        cwd=dev.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        watching = ""
        deadline = time.monotonic() + 120
        while not watching and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if "Watching paths for changes" in line:
                watching = line
        for package in dev.packages():
            assert f"'packages/{package}/src'" in watching, watching
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_a_run_with_a_private_tmp_writes_there_and_the_directory_goes_with_it(tmp_path: Path) -> None:
    report = tmp_path / "report"
    program = (
        "import os, sys, tempfile; d = tempfile.gettempdir(); "
        "open(os.path.join(d, 'left-behind'), 'w').close(); "
        "open(sys.argv[1], 'w').write(d + ' ' + oct(os.stat(d).st_mode & 0o7777))"
    )
    assert dev._run_here([sys.executable, "-c", program, str(report)], private_tmp=True) == 0
    directory, mode = report.read_text().split()
    assert Path(directory).name.startswith("dev-run-") and mode == "0o1777"
    assert not Path(directory).exists()


@pytest.mark.parametrize("command", ["demo", "bench", "suites"])
def test_commands_that_lose_ranks_on_purpose_run_with_a_private_tmp(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[tuple[list[str], bool]] = []

    def run_here(cmd: list[str], private_tmp: bool = False) -> int:
        runs.append((cmd, private_tmp))
        return 0

    monkeypatch.setattr(dev, "_run_here", run_here)
    monkeypatch.setattr(dev, "ensure", lambda name: Path(sys.executable))
    assert getattr(dev, command)([]) == 0
    assert [private for _, private in runs] == [True]
