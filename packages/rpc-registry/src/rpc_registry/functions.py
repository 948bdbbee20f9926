"""``async_execution``: let a called function reply later, through a Future."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Final, TypeVar

from torch.futures import Future
from typing_extensions import ParamSpec

__all__ = ["async_execution", "is_async_execution", "mark_async_execution"]

P = ParamSpec("P")
T = TypeVar("T")

_MARK: Final = "_rpc_registry_async_execution"


def async_execution(fn: Callable[P, Future[T]]) -> Callable[P, Future[T]]:
    """Mark ``fn`` as returning a ``torch.futures.Future`` whose value is the reply.

    The callee's worker thread is released as soon as ``fn`` returns; the
    caller gets the reply when the future completes. Put it innermost when
    combining with ``@staticmethod`` or ``@classmethod``.

    Example::

        @async_execution
        def add_later(to: str, x: torch.Tensor) -> Future[torch.Tensor]:
            return rpc_async(to, torch.add, args=(x, 1)).then(lambda f: f.wait() * 2)

        rpc_sync("worker1", add_later, args=("worker2", torch.ones(2)))
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return fn(*args, **kwargs)

    mark_async_execution(wrapper)
    return wrapper


def mark_async_execution(fn: object) -> None:
    """Mark ``fn`` as :func:`async_execution` without wrapping it (for wrappers made elsewhere)."""
    setattr(fn, _MARK, True)


def is_async_execution(fn: object) -> bool:
    """Whether ``fn`` (a function or a bound method) was decorated with :func:`async_execution`."""
    return bool(getattr(fn, _MARK, False))
