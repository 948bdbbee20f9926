"""The backend registry: one object, updated under a lock, read live by ``BackendType``.

torch rebuilds its ``BackendType`` enum on every registration and rebinds a
module global, so a ``from ... import BackendType`` done earlier goes stale.
Here ``BackendType`` is a fixed class whose attribute, item and iteration
lookups read the registry, so every reference to it sees every backend.

Backends installed as separate distributions are found through the entry-point
group ``rpc_registry.backends``. The group is read once, at the first use of
the registry; a plugin is imported only when its backend is looked up.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from typing_extensions import final

from .constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_RPC_TIMEOUT_SEC,
    ENTRY_POINT_GROUP,
    INSTALL_DEFAULT_BACKEND,
)
from .protocols import (
    BackendPlugin,
    ConstructRpcBackendOptionsHandler,
    InitBackendHandler,
    RpcAgent,
    RpcBackendOptions,
)

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "BackendRegistry",
    "BackendType",
    "BackendValue",
    "backend_registered",
    "construct_rpc_backend_options",
    "init_backend",
    "register_backend",
]


@dataclass(frozen=True)
class BackendValue:
    """The value of a ``BackendType`` member: the backend's two handlers."""

    construct_rpc_backend_options_handler: ConstructRpcBackendOptionsHandler
    init_backend_handler: InitBackendHandler


class _BackendTypeMeta(type):
    """Makes ``BackendType.NAME``, ``BackendType["NAME"]`` and iteration read the registry."""

    def __getattr__(cls, name: str) -> BackendType:
        # Dunder probes (copy, pickle, typing) must not trigger plugin discovery.
        if name.startswith("__"):
            raise AttributeError(name)
        member = _REGISTRY.get(name)
        if member is None:
            raise AttributeError(_unknown_backend_message(name))
        return member

    def __getitem__(cls, name: str) -> BackendType:
        member = _REGISTRY.get(name)
        if member is None:
            raise KeyError(_unknown_backend_message(name))
        return member

    def __iter__(cls) -> Iterator[BackendType]:
        return iter(_REGISTRY.members())

    def __len__(cls) -> int:
        return len(_REGISTRY.members())

    def __contains__(cls, item: object) -> bool:
        return isinstance(item, BackendType) and _REGISTRY.get(item.name) is item


@final
class BackendType(metaclass=_BackendTypeMeta):
    """The registered RPC backends, always read from the live registry.

    Members are reached as ``BackendType.TENSORPIPE`` or
    ``BackendType["TENSORPIPE"]``; iterating gives every registered backend.
    A member has a ``name`` and a ``value`` (a :class:`BackendValue`). Members
    are created by :func:`register_backend` or by plugin discovery, never
    directly.

    Example::

        from rpc_registry import BackendType, register_backend

        register_backend("MYBACKEND", construct_options, init_agent)
        assert BackendType.MYBACKEND is BackendType["MYBACKEND"]
    """

    __slots__ = ("_name", "_value")

    def __init__(self, name: str, value: BackendValue) -> None:
        self._name = name
        self._value = value

    @property
    def name(self) -> str:
        """The backend's name, e.g. ``"TENSORPIPE"``."""
        return self._name

    @property
    def value(self) -> BackendValue:
        """The backend's handlers."""
        return self._value

    def __repr__(self) -> str:
        return f"BackendType.{self._name}"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_member_by_name, (self._name,))


def _member_by_name(name: str) -> BackendType:
    return BackendType[name]


def _unknown_backend_message(name: str) -> str:
    failure = _REGISTRY.load_failure(name)
    if failure is not None:
        return failure
    known = ", ".join(m.name for m in _REGISTRY.members()) or "none"
    hint = (
        f"install it with {INSTALL_DEFAULT_BACKEND}"
        if name == "TENSORPIPE"
        else "install the distribution that provides it, or call register_backend()"
    )
    return f"RPC backend {name!r} is not registered (registered: {known}); {hint}"


def _distribution_name(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    name = getattr(dist, "name", None)
    return name if isinstance(name, str) else f"<unknown distribution of {entry_point.value}>"


class BackendRegistry:
    """Registered backends plus the not yet imported plugins of an entry-point group.

    The module keeps one instance, which ``BackendType`` and the module
    functions use. Separate instances exist for tests and tools that need to
    read an entry-point group in isolation.
    """

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self._group = group
        self._lock = threading.RLock()
        self._members: dict[str, BackendType] = {}
        # None until the entry-point group was read; then the plugins not yet imported.
        self._pending: dict[str, importlib.metadata.EntryPoint] | None = None
        # Plugins whose import failed, and why: tried again when asked for by name.
        self._broken: dict[str, tuple[importlib.metadata.EntryPoint, str]] = {}

    def register(
        self,
        backend_name: str,
        construct_rpc_backend_options_handler: ConstructRpcBackendOptionsHandler,
        init_backend_handler: InitBackendHandler,
    ) -> BackendType:
        """Add a backend and return its member; see :func:`register_backend`."""
        if not _is_identifier(backend_name):
            raise ValueError(
                f"backend_name={backend_name!r}: must be a Python identifier such as "
                "'MYBACKEND', so that BackendType.<name> can reach it"
            )
        if backend_name.startswith("__"):
            raise ValueError(f"backend_name={backend_name!r}: must not start with '__'")
        for arg, handler in (
            ("construct_rpc_backend_options_handler", construct_rpc_backend_options_handler),
            ("init_backend_handler", init_backend_handler),
        ):
            if not callable(handler):
                raise TypeError(f"{arg}={handler!r}: must be callable")
        with self._lock:
            pending = self._discover_locked()
            if backend_name in self._members or backend_name in pending:
                raise RuntimeError(f"RPC backend {backend_name}: already registered")
            member = BackendType(
                backend_name,
                BackendValue(construct_rpc_backend_options_handler, init_backend_handler),
            )
            self._members[backend_name] = member
        logger.debug("registered RPC backend %s", backend_name)
        return member

    def get(self, backend_name: str) -> BackendType | None:
        """The member named ``backend_name``, importing its plugin if needed; else None.

        A plugin whose import failed before is tried again (its environment
        may have been fixed since), without a second warning.
        """
        with self._lock:
            member = self._members.get(backend_name)
            if member is None and backend_name in self._discover_locked():
                member = self._load_locked(backend_name)
            elif member is None and backend_name in self._broken:
                entry_point, _ = self._broken.pop(backend_name)
                assert self._pending is not None
                self._pending[backend_name] = entry_point
                member = self._load_locked(backend_name, warn=False)
            return member

    def load_failure(self, backend_name: str) -> str | None:
        """Why the plugin named ``backend_name`` could not be imported, or None."""
        with self._lock:
            broken = self._broken.get(backend_name)
            return None if broken is None else broken[1]

    def members(self) -> list[BackendType]:
        """Every backend, in registration order; imports the plugins not yet loaded."""
        with self._lock:
            for name in list(self._discover_locked()):
                self._load_locked(name)
            return list(self._members.values())

    def _discover_locked(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self._pending is None:
            found: dict[str, importlib.metadata.EntryPoint] = {}
            for entry_point in importlib.metadata.entry_points(group=self._group):
                name = entry_point.name
                if name in self._members:
                    logger.debug("plugin backend %s is shadowed by a registered one", name)
                elif name in found:
                    warnings.warn(
                        f"RPC backend {name!r} is provided by both distribution "
                        f"{_distribution_name(found[name])} and {_distribution_name(entry_point)}; "
                        f"using the first, uninstall one of them",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                else:
                    found[name] = entry_point
            self._pending = found
        return self._pending

    def _load_locked(self, name: str, warn: bool = True) -> BackendType | None:
        assert self._pending is not None
        entry_point = self._pending.pop(name)
        try:
            loaded = entry_point.load()
            plugin = loaded if isinstance(loaded, BackendPlugin) else loaded()
            _check_plugin(entry_point.name, plugin)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the others
            dist = _distribution_name(entry_point)
            failed = f"RPC backend plugin {name!r} from distribution {dist} could not be loaded"
            cause = f"({type(exc).__name__}: {exc}); reinstall or uninstall {dist}"
            self._broken[name] = (entry_point, f"{failed} {cause}")
            if warn:
                warnings.warn(f"{failed} and is skipped {cause}", RuntimeWarning, stacklevel=4)
            return None
        # A plugin may register itself while being imported.
        member = self._members.get(name)
        if member is None:
            member = BackendType(
                name,
                BackendValue(plugin.construct_rpc_backend_options_handler, plugin.init_backend_handler),
            )
            self._members[name] = member
        logger.debug("loaded RPC backend plugin %s from %s", name, entry_point.value)
        return member


def _check_plugin(entry_point_name: str, plugin: object) -> None:
    if not isinstance(plugin, BackendPlugin):
        raise TypeError(
            f"entry point gave {plugin!r}, which lacks name, "
            "construct_rpc_backend_options_handler or init_backend_handler"
        )
    if plugin.name != entry_point_name:
        raise ValueError(
            f"plugin name {plugin.name!r} differs from its entry point name {entry_point_name!r}"
        )
    handlers: tuple[object, ...] = (
        plugin.construct_rpc_backend_options_handler,
        plugin.init_backend_handler,
    )
    if not all(callable(handler) for handler in handlers):
        raise TypeError("plugin handlers must be callable")


def _is_identifier(name: object) -> bool:
    return isinstance(name, str) and name.isidentifier()


_REGISTRY = BackendRegistry()


def register_backend(
    backend_name: str,
    construct_rpc_backend_options_handler: ConstructRpcBackendOptionsHandler,
    init_backend_handler: InitBackendHandler,
) -> BackendType:
    """Register a backend under ``backend_name`` and return its ``BackendType`` member.

    Raises ``RuntimeError("RPC backend {name}: already registered")`` when the
    name is taken, by an earlier registration or by an installed plugin.
    """
    return _REGISTRY.register(backend_name, construct_rpc_backend_options_handler, init_backend_handler)


def backend_registered(backend_name: str) -> bool:
    """Whether ``backend_name`` is a usable backend (registered, or a plugin that loads)."""
    return _REGISTRY.get(backend_name) is not None


def _require_member(backend: object) -> BackendType:
    if not isinstance(backend, BackendType):
        raise TypeError(f"backend={backend!r}: must be a member of BackendType, e.g. BackendType.TENSORPIPE")
    return backend


def construct_rpc_backend_options(
    backend: BackendType,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
    init_method: str = DEFAULT_INIT_METHOD,
    **kwargs: Any,
) -> RpcBackendOptions:
    """Build ``backend``'s options; every keyword in ``kwargs`` reaches its handler.

    Example::

        options = construct_rpc_backend_options(
            BackendType.TENSORPIPE, rpc_timeout=20, device_maps={"worker1": {0: 1}}
        )
    """
    handler = _require_member(backend).value.construct_rpc_backend_options_handler
    return handler(rpc_timeout=rpc_timeout, init_method=init_method, **kwargs)


def init_backend(backend: BackendType, *args: Any, **kwargs: Any) -> RpcAgent:
    """Create ``backend``'s agent: calls its init handler with ``args`` and ``kwargs``."""
    return _require_member(backend).value.init_backend_handler(*args, **kwargs)
