"""pytest plugin: the run's temporary files go to a directory of its own, removed at its end.

``tools/dev.py test`` loads it into every pytest step (``-p private_tmp``).
Before any test, ``TMPDIR`` points to a new directory (sticky and writable by
all, as ``/tmp``: tests drop to another user), so the run and every process it
starts (ranks, ``torchrun``'s agents) write their temporary files there: the
dumps of the failures the tests cause, launchers' log directories, pytest's
own ``tmp_path``. At the end the summary lists what was left there, then the
directory is removed, so a test run leaves nothing in the temporary directory.
"""

from __future__ import annotations

import multiprocessing.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

#: Entries of the run's directory listed at most in the summary.
_LISTED = 10
#: Names of what is made there by design, not leaks: pytest's own ``tmp_path`` folders, and
#: torch's compile cache (``torchinductor_<user>``, made when ``torch._inductor`` is imported).
_NOT_LEAKS = ("pytest-of-", "torchinductor_")


class PrivateTmp:
    """Holds the run's directory and what ``TMPDIR`` was before it."""

    def __init__(self) -> None:
        self.previous = os.environ.get("TMPDIR")
        # multiprocessing removes its own folder after this plugin's end: it stays outside.
        multiprocessing.util.get_temp_dir()
        self.path = Path(tempfile.mkdtemp(prefix="pytest-run-"))
        self.path.chmod(0o1777)
        os.environ["TMPDIR"] = str(self.path)
        tempfile.tempdir = None  # gettempdir() reads TMPDIR anew

    def left(self) -> list[str]:
        """The entries left in the run's directory, those made by design excepted."""
        return sorted(p.name for p in self.path.iterdir() if not p.name.startswith(_NOT_LEAKS))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        left = self.left()
        if not left:
            return
        shown = ", ".join(left[:_LISTED]) + (
            f" and {len(left) - _LISTED} more" if len(left) > _LISTED else ""
        )
        terminalreporter.section("left in the temporary directory (removed now)")
        terminalreporter.write_line(f"{len(left)} {'entry' if len(left) == 1 else 'entries'}: {shown}")

    def remove(self) -> None:
        """Remove the run's directory and give ``TMPDIR`` back."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self.previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = self.previous
        tempfile.tempdir = None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(PrivateTmp(), "private_tmp_run")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    run = config.pluginmanager.get_plugin("private_tmp_run")
    if isinstance(run, PrivateTmp):
        run.remove()
