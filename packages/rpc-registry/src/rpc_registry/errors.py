"""Errors that are both torch's type and the type this package documents.

torch's RPC raises ``RuntimeError`` for an unknown or duplicate worker name
and ``ValueError`` for a destination of the wrong type, where this package
raises ``ValueError`` and ``TypeError``: these classes are both, so code
written against either catches them.

Example::

    try:
        rpc_registry.get_worker_info("trainer9")
    except RuntimeError:  # torch's type; ValueError catches it as well
        ...
"""

from __future__ import annotations

__all__ = ["WorkerNameError", "WorkerRefTypeError", "not_initialized"]


class WorkerNameError(ValueError, RuntimeError):
    """A worker name or id that is not in the group, or a name that another worker took."""


class WorkerRefTypeError(TypeError, ValueError):
    """A destination that is none of a worker name, a ``WorkerInfo`` or a worker id."""


def not_initialized(rref: bool = False) -> RuntimeError:
    """The error of using RPC (``rref``: creating an RRef) before ``init_rpc`` or after ``shutdown``.

    torch's wording first, which callers may match: it words the two cases differently.
    """
    if rref:
        return RuntimeError(
            "Current RPC agent is not set! Did you initialize the RPC framework? "
            "Call rpc_registry.init_rpc() first"
        )
    return RuntimeError("RPC has not been initialized: call rpc_registry.init_rpc() first")
