"""The tools and the benchmark are scripts, not packages: make them importable by the tests."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
for folder in (ROOT / "tools", ROOT / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
