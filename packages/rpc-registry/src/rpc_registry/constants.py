"""Defaults shared by the registry and the API (the same values as torch's)."""

from __future__ import annotations

from typing import Final

DEFAULT_RPC_TIMEOUT_SEC: Final = 60.0
"""Default timeout of one call, in seconds."""

DEFAULT_INIT_METHOD: Final = "env://"
"""Default rendezvous: ``MASTER_ADDR``/``MASTER_PORT`` (and ``RANK``/``WORLD_SIZE``)."""

DEFAULT_SHUTDOWN_TIMEOUT: Final = 0.0
"""Default timeout of a graceful shutdown, in seconds; ``0`` waits without limit."""

UNSET_RPC_TIMEOUT: Final = -1.0
"""``timeout=-1``: use the agent's default timeout."""

ENTRY_POINT_GROUP: Final = "rpc_registry.backends"
"""Entry-point group through which installed distributions provide backends."""

INSTALL_DEFAULT_BACKEND: Final = (
    "`pip install tensorpipe-backend` (from a checkout: "
    "`pip install ./packages/rpc-registry ./packages/tensorpipe-backend`; other ways: "
    "https://github.com/uneven-joined/uneven-joined#install)"
)
"""How to install the default backend, TENSORPIPE, as error messages say it."""
