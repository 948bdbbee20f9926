"""What the recorder's wrappers hand a watched group's collectives to.

The recorder (:mod:`join_core.recorder`) wraps the collective methods of
torch's ``ProcessGroup``; for a group in :data:`handlers`, its wrapper makes
a :class:`Call` of the collective and hands it to that group's handler
instead of issuing it. :mod:`join_core.intercept` fills :data:`handlers`,
and the recorder sets how a call is issued, recorded (:func:`set_issuer`).
Both import this module, so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import torch.distributed as dist

# Call and Handler are public as join_core.intercept's; the rest is the recorder's and intercept's.
__all__: list[str] = []


class Call(NamedTuple):
    """One intercepted collective: its name as ``torch.distributed`` calls it
    (``all_reduce``), the ``ProcessGroup`` method and arguments it was issued
    with, the frame that called that method, and how to issue it."""

    name: str
    method: str
    group: dist.ProcessGroup
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    caller: FrameType
    issuer: Callable[[dist.ProcessGroup, str, tuple[Any, ...], dict[str, Any], FrameType], Any]

    def proceed(self) -> Any:
        """Issue the call as it was made; its ``Work`` (or None)."""
        return self.issuer(self.group, self.method, self.args, self.kwargs, self.caller)


#: What a watched group's collectives go to; it returns what the method returns.
Handler = Callable[[Call], Any]

#: Watched groups and their handlers; read by the recorder's wrappers.
handlers: dict[dist.ProcessGroup, Handler] = {}
#: The recorder's issuer, once it installed its wrappers.
issuers: list[Callable[[dist.ProcessGroup, str, tuple[Any, ...], dict[str, Any], FrameType], Any]] = []


def set_issuer(
    issuer: Callable[[dist.ProcessGroup, str, tuple[Any, ...], dict[str, Any], FrameType], Any],
) -> None:
    """Called once by the recorder: how to issue a call, recorded, without interception."""
    issuers.append(issuer)
