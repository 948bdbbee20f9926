"""How the job's secret reaches every worker, without ever crossing the store in clear.

In order of precedence:

1. ``TensorPipeRpcBackendOptions(auth_token=...)``;
2. the environment variable ``TENSORPIPE_BACKEND_AUTH_TOKEN`` (what a launcher sets);
3. a secret file: the first worker (rank 0 of a static group) writes a fresh
   random secret to a file only this user can read (mode 0600, in a
   per-user directory of mode 0700: ``$XDG_RUNTIME_DIR/tensorpipe-backend``
   or ``<tmp>/tensorpipe-backend-<uid>``) and publishes the file's *path* in
   the rendezvous store. Every other worker of the same user on the same host
   reads the file; a worker on another host finds no such file and fails at
   ``init_rpc`` with a message saying how to give it a token;
4. with ``insecure=True`` only: the secret itself in the store, as torch's
   agent would do, with a warning. Anyone who can reach the store can then
   read it and run code as this user on every worker.

The store is unauthenticated, so what is read from it is checked: the path
must name a regular file owned by this user, of mode 0600, in a directory
owned by this user of mode 0700, reached without symlinks. A stranger who
writes the key can make ``init_rpc`` fail, never make a worker trust a
secret it did not make. Files are removed when the process that made them
exits; files of processes that died without that are swept at the next start.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import socket
import stat
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Final

from torch.distributed.distributed_c10d import Store

logger = logging.getLogger(__name__)

__all__ = ["AUTH_TOKEN_ENV", "INSECURE_SECRET_KEY", "SECRET_FILE_KEY", "resolve_secret", "secret_dir"]

AUTH_TOKEN_ENV: Final = "TENSORPIPE_BACKEND_AUTH_TOKEN"
"""Environment variable holding the job's secret when ``auth_token`` is not given."""

SECRET_FILE_KEY: Final = "tensorpipe_backend/secret_file"
"""Store key of the secret file's location (a path, not the secret)."""
INSECURE_SECRET_KEY: Final = "tensorpipe_backend/secret"
"""Store key of the secret itself, used only with ``insecure=True``."""

_FILE_NAME: Final = re.compile(r"secret-(?P<pid>[0-9]{1,10})-[0-9a-f]{32}")
_SECRET_HEX_CHARS: Final = 64
_UNLIMITED: Final = 300.0

_made_lock = threading.Lock()
_made: set[Path] = set()  # files this process wrote; removed at exit


def _how_to_fix() -> str:
    return (
        f"set {AUTH_TOKEN_ENV} to the same random value on every worker "
        "(e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`), or pass "
        "TensorPipeRpcBackendOptions(auth_token=...); insecure=True publishes the secret through the "
        "store instead, where anyone who can reach the store can read it"
    )


def secret_dir() -> Path:
    """This user's directory for secret files (mode 0700), created if missing.

    Raises:
        PermissionError: the directory exists but is not this user's own, private directory.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    uid = os.getuid()
    if runtime and _is_private_dir(Path(runtime), uid):
        path = Path(runtime) / "tensorpipe-backend"
    else:
        path = Path(tempfile.gettempdir()) / f"tensorpipe-backend-{uid}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    if not _is_private_dir(path, uid):
        raise PermissionError(
            f"{path}: not a directory of mode 0700 owned by uid {uid}, so it cannot hold the job's "
            f"secret (another user may have made it); remove it, or {_how_to_fix()}"
        )
    return path


def _is_private_dir(path: Path, uid: int) -> bool:
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and stat.S_IMODE(info.st_mode) & 0o077 == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(directory: Path) -> None:
    """Remove the secret files of processes that are gone."""
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            match = _FILE_NAME.fullmatch(entry.name)
            if match and not _pid_alive(int(match["pid"])):
                with contextlib.suppress(OSError):
                    entry.unlink()


def _remove_made() -> None:
    with _made_lock:
        for path in _made:
            with contextlib.suppress(OSError):
                path.unlink()
        _made.clear()


atexit.register(_remove_made)


def _write_secret_file(secret: str) -> Path:
    directory = secret_dir()
    _sweep(directory)
    path = directory / f"secret-{os.getpid()}-{secrets.token_hex(16)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secret.encode())
    finally:
        os.close(fd)
    with _made_lock:
        _made.add(path)
    return path


def _read_secret_file(published: bytes, rank: int) -> bytes:
    """Read the secret from the file named in the store, after checking it is this user's own."""
    try:
        raw = json.loads(published)
        path, host = Path(str(raw["path"])), str(raw["host"])
    except (ValueError, KeyError, TypeError):
        raise RuntimeError(
            f"rank {rank}: the store's {SECRET_FILE_KEY!r} entry is malformed (was it written by "
            f"another program?); {_how_to_fix()}"
        ) from None
    uid = os.getuid()
    if not path.is_absolute() or not _FILE_NAME.fullmatch(path.name) or not _is_private_dir(path.parent, uid):
        raise RuntimeError(
            f"rank {rank}: the job's secret file {str(path)!r} (published by a worker on host {host!r}) "
            f"is not in a private directory of uid {uid} on this host ({socket.gethostname()!r}): "
            f"workers on other hosts, or of another user, need a secret from the launcher: {_how_to_fix()}"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RuntimeError(
            f"rank {rank}: the job's secret file {str(path)!r} (made by a worker on host {host!r}) does "
            f"not exist on this host ({socket.gethostname()!r}): workers on several hosts need a secret "
            f"from the launcher: {_how_to_fix()}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or stat.S_IMODE(info.st_mode) & 0o077:
            raise RuntimeError(
                f"rank {rank}: {str(path)!r} is not a regular file of mode 0600 owned by uid {uid}; "
                f"refusing it as the job's secret; {_how_to_fix()}"
            )
        data = os.read(fd, _SECRET_HEX_CHARS + 1)
    finally:
        os.close(fd)
    try:
        if len(data) != _SECRET_HEX_CHARS:
            raise ValueError("wrong length")
        return bytes.fromhex(data.decode())
    except (ValueError, UnicodeDecodeError):
        raise RuntimeError(f"rank {rank}: {str(path)!r} does not hold a secret of this backend") from None


def _wait_for(store: Store, key: str, rank: int, timeout: float, what: str) -> bytes:
    seconds = timeout if timeout > 0 else _UNLIMITED
    started = time.monotonic()
    try:
        store.wait([key], timedelta(seconds=seconds))
    except RuntimeError as exc:
        raise TimeoutError(
            f"rank {rank}: waited {time.monotonic() - started:.1f} s for {what} in the rendezvous store "
            "and it did not come; "
            f"check that rank 0 runs, or {_how_to_fix()}"
        ) from exc
    value: bytes = store.get(key)
    return value


def resolve_secret(
    auth_token: str | bytes | None,
    store: Store,
    rank: int,
    is_static_group: bool,
    timeout: float,
    insecure: bool = False,
) -> bytes:
    """The job's secret, by the precedence of the module docstring.

    In a static group rank 0 makes the secret file (or, with ``insecure``,
    the store entry) and the others wait at most ``timeout`` seconds for it;
    in a dynamic group the first worker to get there does.

    Raises:
        RuntimeError: the secret file is not on this host or not this user's own.
        TimeoutError: rank 0 did not publish within ``timeout``.
        PermissionError: this user's secret directory is not private.
    """
    if auth_token is not None:
        return auth_token.encode() if isinstance(auth_token, str) else bytes(auth_token)
    from_env = os.environ.get(AUTH_TOKEN_ENV)
    if from_env:
        return from_env.encode()
    fresh = secrets.token_hex(32)
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
        return bytes.fromhex(_wait_for(store, INSECURE_SECRET_KEY, rank, timeout, "rank 0's secret").decode())
    if is_static_group and rank != 0:
        return _read_secret_file(
            _wait_for(store, SECRET_FILE_KEY, rank, timeout, "rank 0's secret file"), rank
        )
    path = _write_secret_file(fresh)
    published = json.dumps({"path": str(path), "host": socket.gethostname()})
    if is_static_group:
        store.set(SECRET_FILE_KEY, published)
        return bytes.fromhex(fresh)
    current = store.compare_set(SECRET_FILE_KEY, "", published)
    if current.decode() == published:
        return bytes.fromhex(fresh)
    with _made_lock:
        _made.discard(path)
    path.unlink()
    return _read_secret_file(current, rank)
