"""How the job's secret reaches every worker, without ever crossing the store in clear.

In order of precedence:

1. ``TensorPipeRpcBackendOptions(auth_token=...)``;
2. the environment variable ``TENSORPIPE_BACKEND_AUTH_TOKEN`` (what a launcher sets);
3. a secret file: the first worker (rank 0 of a static group) writes a fresh
   random secret to a private file of its own (see
   :mod:`tensorpipe_backend.secret_file`) and publishes the file's *path* in
   the rendezvous store. Every other worker of the same user on the same host
   reads the file; a worker on another host finds no such file and fails at
   ``init_rpc`` with a message saying how to give it a token. In a dynamic
   group every member that holds the secret writes a copy of its own and
   publishes its path too, so that the secret lives as long as the group,
   not as long as the worker that made it;
4. with ``insecure=True`` only: the secret itself in the store, as torch's
   agent would do, with a warning. Anyone who can reach the store can then
   read it and run code as this user on every worker.

The store is unauthenticated, so what is read from it is checked (see
:func:`tensorpipe_backend.secret_file.read_secret_file`). A stranger who
writes the key can make ``init_rpc`` fail, never make a worker trust a
secret it did not make.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from torch.distributed.distributed_c10d import Store

from .group import wait_or_fail
from .secret_file import SecretFileError, forget_secret_file, make_secret_file, read_secret_file

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["AUTH_TOKEN_ENV", "INSECURE_SECRET_KEY", "SECRET_FILE_KEY", "holder_key", "resolve_secret"]

AUTH_TOKEN_ENV: Final = "TENSORPIPE_BACKEND_AUTH_TOKEN"
"""Environment variable holding the job's secret when ``auth_token`` is not given."""

SECRET_FILE_KEY: Final = "tensorpipe_backend/secret_file"
"""Store key of the secret file's location (a path, not the secret)."""
INSECURE_SECRET_KEY: Final = "tensorpipe_backend/secret"
"""Store key of the secret itself, used only with ``insecure=True``."""

_UNLIMITED: Final = 300.0
_MODE_CHECK: Final = 0.5  # how often a wait for rank 0's secret looks for the other mode's key
_MAX_HOLDERS: Final = 64  # copies tried by a joining member of a dynamic group


def _how_to_fix() -> str:
    return (
        f"set {AUTH_TOKEN_ENV} to the same random value on every worker "
        "(e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`), or pass "
        "TensorPipeRpcBackendOptions(auth_token=...); insecure=True publishes the secret through the "
        "store instead, where anyone who can reach the store can read it"
    )


def holder_key(name: str) -> str:
    """Store key of the path of the copy of the secret that member ``name`` of a dynamic group keeps."""
    return f"{SECRET_FILE_KEY}/{name}"


def _publish_file(secret: str, made: list[Path]) -> tuple[Path, str]:
    path = make_secret_file(secret)
    made.append(path)
    return path, json.dumps({"path": str(path), "host": socket.gethostname()})


def _read_published(published: bytes, rank: int) -> bytes:
    """Read the secret from the file named in a store entry, after checking it is this user's own."""
    try:
        raw = json.loads(published)
        path, host = Path(str(raw["path"])), str(raw["host"])
    except (ValueError, KeyError, TypeError):
        raise RuntimeError(
            f"rank {rank}: the store's {SECRET_FILE_KEY!r} entry is malformed (was it written by "
            f"another program?); {_how_to_fix()}"
        ) from None
    try:
        return read_secret_file(path)
    except FileNotFoundError:
        raise RuntimeError(
            f"rank {rank}: the job's secret file {str(path)!r} (made by a worker on host {host!r}) does "
            f"not exist on this host ({socket.gethostname()!r}): workers on several hosts need a secret "
            f"from the launcher: {_how_to_fix()}"
        ) from None
    except (SecretFileError, OSError) as exc:
        raise RuntimeError(
            f"rank {rank}: refusing the job's secret file published by a worker on host {host!r} "
            f"(this host: {socket.gethostname()!r}): {exc}; workers on other hosts, or of another user, "
            f"need a secret from the launcher: {_how_to_fix()}"
        ) from None


def _wait_for(store: Store, key: str, rank: int, timeout: float, what: str, other_mode: str) -> bytes:
    """The value of ``key``, once rank 0 published it; fails at once if rank 0 published
    ``other_mode`` instead (it was given another ``insecure``) or reported a failure."""
    seconds = timeout if timeout > 0 else _UNLIMITED
    started = time.monotonic()
    deadline = started + seconds
    while not wait_or_fail(
        store, [key], rank, range(1), max(min(_MODE_CHECK, deadline - time.monotonic()), 0.001)
    ):
        if store.check([other_mode]):
            mine, theirs = (
                ("insecure=True", "did not") if key == INSECURE_SECRET_KEY else ("no insecure", "did")
            )
            raise RuntimeError(
                f"rank {rank}: this worker was given {mine} and rank 0 {theirs}: pass the same "
                f"insecure to every worker, or better, {_how_to_fix()}"
            )
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"rank {rank}: waited {time.monotonic() - started:.1f} s for {what} in the rendezvous store "
                "and it did not come; "
                f"check that rank 0 runs, or {_how_to_fix()}"
            )
    value: bytes = store.get(key)
    return value


def resolve_secret(
    auth_token: str | bytes | None,
    store: Store,
    rank: int,
    is_static_group: bool,
    timeout: float,
    insecure: bool = False,
    name: str = "",
    holders: Sequence[str] = (),
    made: list[Path] | None = None,
) -> bytes:
    """The job's secret, by the precedence of the module docstring.

    In a static group rank 0 makes the secret file (or, with ``insecure``,
    the store entry) and the others wait at most ``timeout`` seconds for it;
    in a dynamic group the first worker to get there does, and a worker
    ``name`` joining later reads the maker's file or the copy of one of the
    members ``holders``, then keeps a copy of its own. The paths of the files
    written go to ``made``.

    Raises:
        RuntimeError: the secret file is not on this host or not this user's own.
        TimeoutError: rank 0 did not publish within ``timeout``.
        OSError: no private file could be made for the secret.
    """
    if auth_token is not None:
        return auth_token.encode() if isinstance(auth_token, str) else bytes(auth_token)
    from_env = os.environ.get(AUTH_TOKEN_ENV)
    if from_env:
        return from_env.encode()
    fresh = secrets.token_hex(32)
    made = [] if made is None else made
    if insecure:
        logger.warning(
            "rank %d: insecure=True: the job's secret goes through the rendezvous store in clear; anyone "
            "who can reach the store can call any function on every worker as this user",
            rank,
        )
        if not is_static_group:
            return bytes.fromhex(store.compare_set(INSECURE_SECRET_KEY, "", fresh).decode())
        if rank == 0:
            store.set(INSECURE_SECRET_KEY, fresh)
            return bytes.fromhex(fresh)
        return bytes.fromhex(
            _wait_for(store, INSECURE_SECRET_KEY, rank, timeout, "rank 0's secret", SECRET_FILE_KEY).decode()
        )
    if is_static_group:
        if rank != 0:
            return _read_published(
                _wait_for(store, SECRET_FILE_KEY, rank, timeout, "rank 0's secret file", INSECURE_SECRET_KEY),
                rank,
            )
        store.set(SECRET_FILE_KEY, _publish_file(fresh, made)[1])
        return bytes.fromhex(fresh)
    return _resolve_dynamic(store, rank, name, holders, fresh, made)


def _resolve_dynamic(
    store: Store, rank: int, name: str, holders: Sequence[str], fresh: str, made: list[Path]
) -> bytes:
    if not store.check([SECRET_FILE_KEY]):
        path, published = _publish_file(fresh, made)
        current = store.compare_set(SECRET_FILE_KEY, "", published)
        if current.decode() == published:
            if name:
                store.set(holder_key(name), published)
            return bytes.fromhex(fresh)
        forget_secret_file(path)
    entries = [store.get(SECRET_FILE_KEY)]
    for holder in holders[-_MAX_HOLDERS:]:
        if holder != name and store.check([holder_key(holder)]):
            entries.append(store.get(holder_key(holder)))
    first_error: RuntimeError | None = None
    for entry in entries:
        try:
            secret = _read_published(entry, rank)
        except RuntimeError as exc:
            first_error = first_error or exc
            continue
        if name:
            store.set(holder_key(name), _publish_file(secret.hex(), made)[1])
        return secret
    assert first_error is not None
    raise first_error
