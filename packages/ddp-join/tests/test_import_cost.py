"""Importing ddp_join costs what DDP and ZeRO need: FSDP2 comes with FSDPJoinable only."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
import ddp_join
fsdp2 = ("torch.distributed.fsdp", "torch.distributed.tensor")
before = [name for name in fsdp2 if name in sys.modules]
from ddp_join import FSDPJoinable
print(before, FSDPJoinable.__module__, all(name in sys.modules for name in fsdp2))
"""


def test_fsdp2_and_dtensor_are_imported_only_when_fsdpjoinable_is_asked_for() -> None:
    # They took an import of ddp_join from 2.9 to 4.3 s of CPU (sympy and DTensor's ops).
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["[]", "ddp_join.fsdp", "True"]


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import ddp_join

    with pytest.raises(AttributeError, match="FSDPJoinabel"):
        ddp_join.FSDPJoinabel  # type: ignore[attr-defined]  # noqa: B018
