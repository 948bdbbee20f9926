"""What a timeout argument may be: seconds >= 0, where ``0`` (torch's way) and ``inf`` wait
without limit; anything else is refused at the call, naming the argument."""

from __future__ import annotations

import math
from typing import Final

# The API's machinery, no public API.
__all__: list[str] = []

# Longer waits than this are waits without limit: threads cannot wait this long at once
# (threading.TIMEOUT_MAX is about 292 years), and no call outlives a century.
_NO_LIMIT_FROM: Final = 100 * 365 * 24 * 3600.0


def checked_timeout(name: str, value: object, also: str = "") -> float:
    """``value`` as seconds for argument ``name`` (``0``: no limit); ``also`` names other values
    the caller accepts, for the message. ``TypeError`` or ``ValueError`` naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be seconds (a number) >= 0, 0 waiting without limit{also}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name}={value!r}: must be seconds >= 0, 0 waiting without limit{also}")
    return 0.0 if value >= _NO_LIMIT_FROM else float(value)
