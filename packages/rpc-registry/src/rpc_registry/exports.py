"""Names of ``torch.distributed.rpc`` that a backend provides, found lazily.

``rpc_registry.TensorPipeRpcBackendOptions`` and ``rpc_registry.TensorPipeAgent``
are the classes that the registered backends' handlers declare as their
return types (``-> TensorPipeRpcBackendOptions``, ``-> TensorPipeAgent``). They
are looked up on first access, so importing ``rpc_registry`` loads no
backend.
"""

from __future__ import annotations

import logging
import typing
from typing import Any

from .registry import BackendType

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["backend_export"]


def _return_type(handler: object) -> type[Any] | None:
    # A plain function, or an object whose class defines __call__.
    for candidate in (handler, vars(type(handler)).get("__call__")):
        try:
            hints = typing.get_type_hints(candidate)
        except Exception as exc:  # noqa: BLE001 - a handler whose hints do not resolve exports nothing
            logger.debug("cannot read the return type of %r: %s", candidate, exc)
            continue
        returned = hints.get("return")
        if isinstance(returned, type):
            return returned
    return None


def backend_export(name: str) -> type[Any] | None:
    """The class called ``name`` that a registered backend's handlers return, if any."""
    for member in BackendType:
        value = member.value
        for handler in (value.construct_rpc_backend_options_handler, value.init_backend_handler):
            returned = _return_type(handler)
            if returned is not None and returned.__name__ == name:
                return returned
    return None
