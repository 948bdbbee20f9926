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

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from join_core.handoff import Call, Handler, handlers, issuers
from join_core.recorder import record_collectives  # its wrappers hand calls here

__all__ = ["Call", "Handler", "intercept", "issue", "watched"]

_lock = threading.Lock()


def issue(group: dist.ProcessGroup, method: str, *args: Any) -> Any:
    """Issue ``group.<method>(*args)`` recorded but not intercepted; its ``Work``."""
    return issuers[0](group, method, args, {}, sys._getframe(1))


def watched(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s collectives are intercepted right now."""
    return group in handlers


@contextmanager
def intercept(group: dist.ProcessGroup, handler: Handler) -> Iterator[None]:
    """Send every collective on ``group`` to ``handler`` inside the block.

    Raises:
        RuntimeError: ``group`` is already watched.
    """
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
