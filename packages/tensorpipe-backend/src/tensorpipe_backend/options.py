"""The backend's options: timeouts, worker threads, device maps, devices and the secret.

Device rules are torch's: a device map is 1-to-1, ``devices`` lists CUDA
devices only, and a bare ``int`` means ``cuda:<int>`` (torch would ask the
current accelerator, which fails on a machine without one).
"""

from __future__ import annotations

from typing import Any, Final, Union, cast

import torch

from rpc_registry import DEFAULT_INIT_METHOD, DEFAULT_RPC_TIMEOUT_SEC, RpcBackendOptions

__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT",
    "DEFAULT_NUM_WORKER_THREADS",
    "DeviceMap",
    "DeviceType",
    "TensorPipeRpcBackendOptions",
    "construct_rpc_backend_options_handler",
    "to_device",
    "to_device_map",
]

DeviceType = Union[int, str, torch.device]  # noqa: UP007 - a runtime alias on Python 3.10
"""What a device may be given as: ``0`` (``cuda:0``), ``"cuda:1"``, ``"cpu"`` or a ``torch.device``."""

DeviceMap = dict[torch.device, torch.device]
"""A normalized device map: this worker's device to the peer's device."""

DEFAULT_NUM_WORKER_THREADS: Final = 16
"""Default number of threads that hand incoming calls to the RPC layer."""

# The longest timeout of the options: threads wait at most about 292 years at once.
_MAX_SECONDS: Final = 365 * 24 * 3600.0
# The shortest liveness timeout: a keepalive goes every fifth of it.
_MIN_LIVENESS_SECONDS: Final = 0.1

DEFAULT_LIVENESS_TIMEOUT: Final = 30.0
"""Default ``liveness_timeout``: seconds a connected peer may send nothing before it is judged lost.

Long enough that a live worker whose interpreter is held up for seconds (a
collection of a large heap, a long call that keeps the GIL) is not judged
lost, short of the 60 s that a call to a frozen worker would otherwise wait."""


def to_device(device: DeviceType) -> torch.device:
    """Normalize ``device``; an ``int`` ``i`` is ``cuda:i``.

    Example::

        assert to_device(1) == torch.device("cuda:1")
    """
    if isinstance(device, bool):
        raise TypeError(f"device={device!r}: must be an int, a str or a torch.device, not a bool")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device}: a CUDA device index must be >= 0")
        return torch.device("cuda", device)
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device={device!r}: not a device ({exc}); use e.g. 'cuda:0' or 'cpu'") from exc
    raise TypeError(f"device={device!r}: must be an int, a str or a torch.device")


def _to_cuda_device(device: DeviceType) -> torch.device:
    normalized = to_device(device)
    if normalized.type != "cuda":
        raise ValueError(
            f"`set_devices` expect a list of CUDA devices, but got device type {normalized.type} "
            f"(devices entry {device!r}); list only CUDA devices such as 'cuda:0' or 0"
        )
    if cast("int | None", normalized.index) is None:
        raise ValueError(f"devices entry {device!r}: give the CUDA device index, e.g. 'cuda:0'")
    return normalized


def to_device_map(device_map: dict[DeviceType, DeviceType]) -> DeviceMap:
    """Normalize a device map, rejecting two sources mapped to one target."""
    if not isinstance(device_map, dict):
        raise TypeError(f"device_map={device_map!r}: must be a dict from this worker's devices to the peer's")
    full: DeviceMap = {}
    reverse: DeviceMap = {}
    for key, value in device_map.items():
        source, target = to_device(key), to_device(value)
        if target in reverse:
            raise ValueError(
                "`device_map` only supports 1-to-1 mapping, "
                f"trying to map {source} and {reverse[target]} to {target}"
            )
        full[source] = target
        reverse[target] = source
    return full


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """Options of the TENSORPIPE backend (see ``rpc_registry.init_rpc``).

    ``num_worker_threads`` threads hand incoming calls to the RPC layer;
    ``rpc_timeout`` is the default timeout of a call in seconds (``0``: none);
    ``device_maps[peer]`` maps this worker's devices to ``peer``'s, and
    ``devices`` lists the local CUDA devices the agent uses (by default the
    ones the maps mention). ``auth_token`` is the job's shared secret; without
    it, the environment variable ``TENSORPIPE_BACKEND_AUTH_TOKEN`` is used,
    else rank 0 generates one in a file only this user can read, which the
    workers of the same host find (workers on other hosts then fail at init
    and say how to pass a token). ``insecure=True`` shares a generated secret
    through the rendezvous store instead, where anyone who can reach the store
    can read it (a warning is logged). ``rendezvous_timeout`` is how long
    ``init_rpc`` waits for the other workers of a static group, in seconds
    (``None``: torch's 30 minutes; a warning names the missing ranks every
    few seconds). ``liveness_timeout`` is how long a connected peer may send
    nothing (not even the keepalive every worker sends each quarter of it)
    before it is judged lost, in seconds (``0``: never; a peer whose process
    ended is judged lost at once, from its closed connection, either way);
    see :mod:`tensorpipe_backend.liveness`. ``_transports`` and ``_channels``
    are accepted for compatibility with torch and must be ``None``.

    Example::

        options = TensorPipeRpcBackendOptions(num_worker_threads=8, device_maps={"worker1": {0: 1}})
        options.set_device_map("worker1", {1: 2})
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: dict[str, dict[DeviceType, DeviceType]] | None = None,
        devices: list[DeviceType] | None = None,
        _transports: list[Any] | None = None,
        _channels: list[Any] | None = None,
        auth_token: str | bytes | None = None,
        insecure: bool = False,
        rendezvous_timeout: float | None = None,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT,
    ) -> None:
        if isinstance(num_worker_threads, bool) or not isinstance(num_worker_threads, int):
            raise TypeError(f"num_worker_threads={num_worker_threads!r}: must be an int >= 1")
        if num_worker_threads < 1:
            raise ValueError(f"num_worker_threads={num_worker_threads}: must be >= 1, e.g. 16")
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)):
            # torch's phrase first (its pybind error), which callers may match.
            raise TypeError(
                f"TensorPipeRpcBackendOptions(): incompatible constructor arguments: rpc_timeout={rpc_timeout!r} "
                "must be seconds as a float (for a timedelta, pass .total_seconds())"
            )
        if not 0 <= rpc_timeout <= _MAX_SECONDS:
            raise ValueError(
                f"rpc_timeout={rpc_timeout!r}: must be seconds >= 0 (0 means no timeout), at most a year"
            )
        if not isinstance(init_method, str):
            raise TypeError(
                f"init_method={init_method!r}: must be a URL such as 'env://' or 'tcp://host:port'"
            )
        for arg, value in (("_transports", _transports), ("_channels", _channels)):
            if value is not None:
                raise ValueError(
                    f"{arg}={value!r}: this backend has one socket transport and no channels to choose; "
                    "leave it None"
                )
        if auth_token is not None:
            if not isinstance(auth_token, (str, bytes)):
                raise TypeError(f"auth_token={auth_token!r}: must be a str or bytes secret")
            if len(auth_token) == 0:
                raise ValueError(
                    "auth_token='': must not be empty; pass None to use the environment or store"
                )
        if not isinstance(insecure, bool):
            raise TypeError(f"insecure={insecure!r}: must be True or False")
        given: object = rendezvous_timeout
        if given is not None and (
            isinstance(given, bool) or not isinstance(given, (int, float)) or not 0 < given <= _MAX_SECONDS
        ):
            raise ValueError(
                f"rendezvous_timeout={rendezvous_timeout!r}: must be seconds > 0 and at most a year, or None "
                "for torch's 30 minutes"
            )
        live: object = liveness_timeout
        if (
            isinstance(live, bool)
            or not isinstance(live, (int, float))
            or not (live == 0 or _MIN_LIVENESS_SECONDS <= live <= _MAX_SECONDS)
        ):
            raise ValueError(
                f"liveness_timeout={liveness_timeout!r}: must be seconds >= 0, e.g. "
                f"{DEFAULT_LIVENESS_TIMEOUT:g} (0: judge a peer lost only when its connection closes), at "
                f"least {_MIN_LIVENESS_SECONDS:g} and at most a year"
            )
        if device_maps is not None and not isinstance(device_maps, dict):
            raise TypeError(f"device_maps={device_maps!r}: must be a dict from worker name to device map")
        self.num_worker_threads: int = num_worker_threads
        self.rpc_timeout: float = float(rpc_timeout)
        self.init_method: str = init_method
        self.auth_token: str | bytes | None = auth_token
        self.insecure: bool = insecure
        self.rendezvous_timeout: float | None = (
            None if rendezvous_timeout is None else float(rendezvous_timeout)
        )
        self.liveness_timeout: float = float(liveness_timeout)
        self._transports = _transports
        self._channels = _channels
        self._device_maps: dict[str, DeviceMap] = {}
        for to, device_map in (device_maps or {}).items():
            self._check_worker_name(to)
            self._device_maps[to] = to_device_map(device_map)
        self._devices: list[torch.device] = []
        if devices is not None:
            self.set_devices(devices)

    @staticmethod
    def _check_worker_name(to: object) -> None:
        if not isinstance(to, str) or not to:
            raise TypeError(f"device_maps key {to!r}: must be the callee's worker name (a non-empty str)")

    @property
    def device_maps(self) -> dict[str, DeviceMap]:
        """A copy of the device maps: callee name to {this worker's device: callee's device}."""
        return {to: dict(device_map) for to, device_map in self._device_maps.items()}

    @property
    def devices(self) -> list[torch.device]:
        """The local CUDA devices the agent uses (empty: derived from the device maps)."""
        return list(self._devices)

    @devices.setter
    def devices(self, devices: list[DeviceType]) -> None:
        self.set_devices(devices)

    def set_device_map(self, to: str, device_map: dict[DeviceType, DeviceType]) -> None:
        """Add device placements from this worker to callee ``to``; may be called repeatedly.

        Example::

            options.set_device_map("worker1", {0: 1})  # this cuda:0 lands on worker1's cuda:1
        """
        self._check_worker_name(to)
        full = to_device_map(device_map)
        current = self._device_maps.get(to, {})
        for source, target in full.items():
            if source in current and current[source] != target:
                raise ValueError(
                    "`set_device_map` only supports 1-to-1 mapping, trying"
                    f" to map {source} to {target} and {current[source]}"
                )
        merged = dict(current)
        merged.update(full)
        # The merge may map two sources to one target: check the result too.
        self._device_maps[to] = to_device_map(cast("dict[DeviceType, DeviceType]", merged))

    def set_devices(self, devices: list[DeviceType]) -> None:
        """Set the local CUDA devices the agent uses (``ints`` mean ``cuda:i``)."""
        if not isinstance(devices, (list, tuple)):
            raise TypeError(f"devices={devices!r}: must be a list of CUDA devices, e.g. [0, 'cuda:1']")
        self._devices = [_to_cuda_device(device) for device in devices]

    def __repr__(self) -> str:
        return (
            f"TensorPipeRpcBackendOptions(num_worker_threads={self.num_worker_threads}, "
            f"rpc_timeout={self.rpc_timeout}, init_method={self.init_method!r}, "
            f"device_maps={self._device_maps}, devices={self._devices}, "
            f"auth_token={'<set>' if self.auth_token is not None else None}, insecure={self.insecure}, "
            f"rendezvous_timeout={self.rendezvous_timeout}, liveness_timeout={self.liveness_timeout})"
        )


def construct_rpc_backend_options_handler(
    rpc_timeout: float,
    init_method: str,
    num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
    _transports: list[Any] | None = None,
    _channels: list[Any] | None = None,
    **kwargs: Any,
) -> TensorPipeRpcBackendOptions:
    """The backend's options handler: every keyword reaches :class:`TensorPipeRpcBackendOptions`."""
    return TensorPipeRpcBackendOptions(
        rpc_timeout=rpc_timeout,
        init_method=init_method,
        num_worker_threads=num_worker_threads,
        _transports=_transports,
        _channels=_channels,
        **kwargs,
    )
