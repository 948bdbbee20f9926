"""pytest plugin: a test that runs longer than ``LIMIT_S`` needs a reason written beside it.

    @pytest.mark.slow(reason="spawns 4 ranks that each import torch, then waits out a 5 s liveness timeout")
    def test_...

``tools/dev.py test`` loads it into every pytest step (``-p slow_tests``). A test
(setup, call and teardown together) past ``LIMIT_S`` without a ``slow`` mark
fails the run, named with its time; the summary lists every test past the
limit with its reason. Tests marked slow that now finish fast are listed too,
so stale reasons are seen.
"""

from __future__ import annotations

import pytest

#: Longest a test may run without a reason beside it (ini option ``slow_test_limit``).
LIMIT_S = 30.0


class SlowTests:
    """Sums each test's phases and judges them at the end of the session."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.stale = limit / 3  # a marked test faster than this is listed as no longer slow
        self.seconds: dict[str, float] = {}
        self.reasons: dict[str, str | None] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            mark = item.get_closest_marker("slow")
            if mark is None:
                continue
            reason = mark.kwargs.get("reason", mark.args[0] if mark.args else "")
            if not isinstance(reason, str) or not reason.strip():
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.slow needs reason='why it is slow'")
            self.reasons[item.nodeid] = reason.strip()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def unexplained(self) -> list[str]:
        """Tests past the limit with no reason beside them."""
        return [n for n, s in self.seconds.items() if s > self.limit and n not in self.reasons]

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        over = sorted((s, n) for n, s in self.seconds.items() if s > self.limit)
        stale = sorted((s, n) for n, s in self.seconds.items() if n in self.reasons and s < self.stale)
        if not over and not stale:
            return
        terminalreporter.section(f"tests past {self.limit:g} s")
        for seconds, nodeid in reversed(over):
            reason = (
                self.reasons.get(nodeid)
                or "NO REASON: mark it @pytest.mark.slow(reason=...) or make it faster"
            )
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}: {reason}")
        for seconds, nodeid in stale:
            terminalreporter.write_line(
                f"{seconds:6.1f} s  {nodeid}: marked slow, now under {self.stale:g} s"
            )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.unexplained() and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "slow_test_limit",
        "seconds a test may run without @pytest.mark.slow(reason=...)",
        default=str(LIMIT_S),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow(reason): the test runs past 30 s; reason says why")
    config.pluginmanager.register(SlowTests(float(config.getini("slow_test_limit"))), "slow-tests")
