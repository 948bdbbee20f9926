"""Seeing the collectives issued on one process group, for as long as asked.

:func:`intercept` replaces a few functions of the ``torch.distributed``
namespace (:data:`INTERCEPTED`) with wrappers while at least one process group
is watched, and puts the originals back when the last watch ends. A wrapper
costs one dictionary look-up for a collective on a group nobody watches, from
any thread; a collective on a watched group goes to that group's handler,
whichever thread issues it (DDP's gradient hooks run on autograd's threads on
CUDA). If something else replaced one of these functions meanwhile, it is left
in place: a wrapper with no watched group passes every call straight on.

Only calls through the ``torch.distributed`` namespace are seen
(``dist.all_reduce(...)``, ``torch.distributed.broadcast(...)``): a function
imported by name before the watch began, ``distributed_c10d``'s own functions
and functional collectives go straight to the process group.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Final, NamedTuple

import torch.distributed as dist

__all__ = ["INTERCEPTED", "Call", "Handler", "intercept", "original"]

#: The intercepted functions of ``torch.distributed``, with their parameters in order.
INTERCEPTED: Final[dict[str, tuple[str, ...]]] = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "broadcast": ("tensor", "src", "group", "async_op", "group_src"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_single": ("output_tensor", "input_tensor", "group", "async_op"),
    "reduce_scatter_tensor": ("output", "input", "op", "group", "async_op"),
    "reduce": ("tensor", "dst", "op", "group", "async_op", "group_dst"),
    "barrier": ("group", "async_op", "device_ids", "timeout"),
}


_POSITIONS: Final = {name: {p: i for i, p in enumerate(params)} for name, params in INTERCEPTED.items()}


class Call(NamedTuple):
    """One intercepted call: which function, its arguments as given, the frame
    that called it, and the function it would have reached."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    caller: FrameType
    original: Callable[..., Any]

    def argument(self, key: str, default: Any = None) -> Any:
        """The argument ``key`` (a name of ``INTERCEPTED[self.name]``), or ``default``."""
        index = _POSITIONS[self.name][key]
        return self.args[index] if index < len(self.args) else self.kwargs.get(key, default)

    def proceed(self) -> Any:
        """Make the call as it was issued."""
        return self.original(*self.args, **self.kwargs)


#: What a watched group's collectives go to; it returns what the call returns.
Handler = Callable[[Call], Any]

_lock = threading.Lock()
_handlers: dict[dist.ProcessGroup, Handler] = {}
_world: list[dist.ProcessGroup | None] = [None]  # the default group while a group is watched
_originals: dict[str, Callable[..., Any]] = {}
_wrappers: dict[str, Callable[..., Any]] = {}


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    group_index = INTERCEPTED[name].index("group")
    new = tuple.__new__  # a NamedTuple's own constructor costs a microsecond more

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _handlers:
            return original(*args, **kwargs)
        group = kwargs.get("group") if len(args) <= group_index else args[group_index]
        handler = _handlers.get(group if group is not None else _world[0])  # type: ignore[arg-type]
        if handler is None:
            return original(*args, **kwargs)
        return handler(new(Call, (name, args, kwargs, sys._getframe(1), original)))

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def original(name: str) -> Callable[..., Any]:
    """The un-intercepted ``torch.distributed`` function ``name``."""
    found = _originals.get(name)
    if found is None:
        found = getattr(dist, name)
    return found


@contextmanager
def intercept(group: dist.ProcessGroup, handler: Handler) -> Iterator[None]:
    """Send every intercepted collective on ``group`` to ``handler`` inside the block.

    Raises:
        RuntimeError: ``group`` is already watched.
    """
    with _lock:
        if group in _handlers:
            raise RuntimeError(
                "intercept(group): this process group's collectives are already intercepted; "
                "use one ShadowCollectives per process group at a time"
            )
        if not _handlers:
            for name in INTERCEPTED:
                current = getattr(dist, name, None)
                if current is None:
                    continue  # not in this torch version
                wrapper = _wrappers.get(name)
                if wrapper is None or _originals.get(name) is not current:
                    wrapper = _wrappers[name] = _wrap(name, current)
                    _originals[name] = current
                setattr(dist, name, wrapper)
            _world[0] = dist.group.WORLD
        _handlers[group] = handler
    try:
        yield
    finally:
        with _lock:
            del _handlers[group]
            if not _handlers:
                for name, wrapper in _wrappers.items():
                    if getattr(dist, name, None) is wrapper:
                        setattr(dist, name, _originals[name])
