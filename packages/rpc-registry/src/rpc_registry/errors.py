"""Errors that are both torch's type and the type this package documents.

torch's RPC raises ``RuntimeError`` for an unknown or duplicate worker name,
``ValueError`` for a destination of the wrong type, and ``RuntimeError`` for
a torch operator called with arguments none of its schemas takes, where
Python (and this package) raises ``ValueError``, ``TypeError`` and
``TypeError``: these classes are both, so code written against either
catches them.

Example::

    try:
        rpc_registry.get_worker_info("trainer9")
    except RuntimeError:  # torch's type; ValueError catches it as well
        ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import torch

T = TypeVar("T")

__all__ = [
    "ModuleClassError",
    "OperatorSchemaError",
    "WorkerNameError",
    "WorkerRefTypeError",
    "check_operator_arguments",
    "not_initialized",
]

# Matches arguments to an operator's schemas without running it (what torch's
# RPC does at the call).
_resolve_packet: Final[Callable[..., str]] = vars(torch._C)[
    "_jit_resolve_packet"
]  # not in every torch's stubs


class WorkerNameError(ValueError, RuntimeError):
    """A worker name or id that is not in the group, or a name that another worker took."""


class WorkerRefTypeError(TypeError, ValueError):
    """A destination that is none of a worker name, a ``WorkerInfo`` or a worker id."""


class ModuleClassError(ValueError, TypeError):
    """``RemoteModule(module_cls=...)`` with a ``module_cls`` that does not build an
    ``nn.Module``: a ``ValueError`` as torch's, and a ``TypeError`` as the argument's type is wrong."""


class OperatorSchemaError(RuntimeError, TypeError):
    """A torch operator (``torch.add``, ...) called through RPC with arguments none of its
    schemas takes; the message starts with torch's wording and goes on with Python's."""


def operator_call(func: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    """``func(*args, **kwargs)``; a ``TypeError`` of a torch operator's argument parsing
    becomes :class:`OperatorSchemaError`, as torch's agent reports it."""
    try:
        return func(*args, **kwargs)
    except TypeError as exc:
        if not _is_torch_operator(func):
            raise
        # torch's wording first, which callers may match.
        raise OperatorSchemaError(
            f"Overloaded torch operator invoked from Python failed to match any schema: {exc}"
        ) from exc


def _is_torch_operator(func: object) -> bool:
    return (
        type(func).__name__ == "builtin_function_or_method" and getattr(func, "__module__", None) == "torch"
    )


def check_operator_arguments(func: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`OperatorSchemaError` at the call, as torch's RPC does, when ``func`` is a
    torch operator none of whose schemas takes these arguments.

    An operator called through RPC is matched against its TorchScript schemas,
    which are stricter than its Python binding: ``torch.zeros(3)`` runs in
    Python, but through RPC the size must be a list, ``args=((3,),)``.
    """
    if not _is_torch_operator(func):
        return
    try:
        packet = getattr(torch.ops.aten, getattr(func, "__name__", ""))
    except (AttributeError, RuntimeError):
        return  # not an aten operator: called as a plain Python function
    try:
        _resolve_packet(packet._qualified_op_name, *args, **kwargs)
    except RuntimeError as exc:
        raise OperatorSchemaError(str(exc)) from None


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


def _name_of(func: object) -> str:
    """How errors and logs name a called function: its qualified name, else its repr."""
    return getattr(func, "__qualname__", None) or repr(func)
