"""pytest plugin: every ```python block of the Markdown files given as a test.

    PYTHONPATH=tools python -m pytest -p docs_examples README.md packages/*/README.md docs

sybil finds the blocks (tools/docs_check.py's ``SYBIL``); each runs from an
empty folder as a script, or on N local ranks when its first lines name
``torchrun --nproc-per-node N``, and must exit 0.
"""

from __future__ import annotations

from docs_check import SYBIL

pytest_collect_file = SYBIL.pytest()
