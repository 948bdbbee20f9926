"""Seeing the collectives issued on one process group, for as long as asked.

Every collective reaches a method of torch's ``ProcessGroup`` class however
it is called (``dist.all_reduce``, a function imported by name, an async
call whose ``Work`` is waited on later, FSDP2's and our DDP's own calls), and
the recorder (:mod:`join_core.recorder`) wraps those methods once per
process. While :func:`intercept` watches a group, the wrapper hands that
group's collectives to its handler, whichever thread issues them (DDP's
gradient hooks run on autograd's threads on CUDA); for other groups it costs
one dictionary look-up. :meth:`Call.proceed` issues the call as it was made,
and :func:`issue` issues another on the group, both recorded and neither
handed to the handler again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NamedTuple

import torch.distributed as dist

__all__ = ["Call", "Handler", "intercept", "issue", "watched"]


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

_lock = threading.Lock()
#: Watched groups and their handlers; read by the recorder's wrappers.
handlers: dict[dist.ProcessGroup, Handler] = {}
_issuer: list[Callable[[dist.ProcessGroup, str, tuple[Any, ...], dict[str, Any], FrameType], Any]] = []


def set_issuer(
    issuer: Callable[[dist.ProcessGroup, str, tuple[Any, ...], dict[str, Any], FrameType], Any],
) -> None:
    """Called once by the recorder: how to issue a call, recorded, without interception."""
    _issuer.append(issuer)


def issue(group: dist.ProcessGroup, method: str, *args: Any) -> Any:
    """Issue ``group.<method>(*args)`` recorded but not intercepted; its ``Work``."""
    import sys

    return _issuer[0](group, method, args, {}, sys._getframe(1))


def watched(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s collectives are intercepted right now."""
    return group in handlers


@contextmanager
def intercept(group: dist.ProcessGroup, handler: Handler) -> Iterator[None]:
    """Send every collective on ``group`` to ``handler`` inside the block.

    Raises:
        RuntimeError: ``group`` is already watched.
    """
    from join_core.recorder import record_collectives  # the recorder's wrappers hand calls here

    record_collectives()
    with _lock:
        if group in handlers:
            raise RuntimeError(
                "intercept(group): this process group's collectives are already intercepted; "
                "use one ShadowCollectives per process group at a time"
            )
        handlers[group] = handler
    try:
        yield
    finally:
        with _lock:
            del handlers[group]
