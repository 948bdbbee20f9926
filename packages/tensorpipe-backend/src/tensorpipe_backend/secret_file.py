"""The job's secret in a private file of this host: made, checked, read, and removed.

A worker that makes the secret writes it to ``secret`` in a directory of its
own, ``<base>/tensorpipe-backend-<uid>-<pid>-<random>``, where ``<base>`` is
``$XDG_RUNTIME_DIR`` when that is this user's private directory, else the
temporary directory. The directory is made by one ``mkdir`` of mode 0700
under a name nobody can guess (128 random bits), which fails on anything
already there, a symlink included; the file is created through the
directory's descriptor, exclusively, without following links. So a name
another user squatted, or a link they planted, is never written through
and never keeps a job from starting: another name is drawn.

A reader trusts a path only if it names such a directory of its own user,
reached without symlinks, holding a regular file of mode 0600 of that user.

A process writes one file per secret (asked again, it gives the same path).
The agent removes a static group's file at shutdown and any file of an
``init_rpc`` that failed. Files go with the process that made them in any
case: at interpreter exit, and, for a
process ended by a signal (SIGTERM, a launcher's way of stopping workers,
or SIGKILL), by a small helper process that waits for the maker's end and
removes them. The helper ignores the signals of its maker's terminal and
exits as soon as the files are gone. Directories of processes that are gone
are also swept at the next start.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Final

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["SecretFileError", "forget_secret_file", "make_secret_file", "read_secret_file", "secret_base"]

FILE_NAME: Final = "secret"
_DIR_NAME: Final = re.compile(r"tensorpipe-backend-(?P<uid>[0-9]{1,10})-(?P<pid>[0-9]{1,10})-[0-9a-f]{32}")
_SECRET_HEX_CHARS: Final = 64
_MAX_DRAWS: Final = 16
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW

# Waits for its maker's end (EOF on stdin), then removes the files named in argv; run with -I -S.
_REAPER: Final = """
import os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
while os.read(0, 64):
    pass
for path in sys.argv[1:]:
    try:
        os.unlink(path)
    except OSError:
        pass
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass
"""


class SecretFileError(RuntimeError):
    """A path given as the job's secret file is not one this user's workers made; says why."""


class _Made:
    """A file this process made, and the helper that removes it should this process be killed."""

    def __init__(self, path: Path, secret: str, reaper: subprocess.Popen[bytes] | None) -> None:
        self.path = path
        self.secret = secret
        self.reaper = reaper
        self.pid = os.getpid()

    def remove(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child exiting: the file is its parent's, still in use
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()
        reaper = self.reaper
        if reaper is not None and reaper.stdin is not None:
            reaper.stdin.close()  # EOF: it finds nothing left and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                reaper.wait(timeout=5)


_made_lock = threading.Lock()
_made: dict[Path, _Made] = {}


def _remove_all() -> None:
    with _made_lock:
        made = list(_made.values())
        _made.clear()
    for entry in made:
        entry.remove()


atexit.register(_remove_all)


def _is_private_dir(path: Path, uid: int) -> bool:
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and stat.S_IMODE(info.st_mode) & 0o077 == 0


def secret_base() -> Path:
    """Where this user's secret directories are made: ``$XDG_RUNTIME_DIR`` if it is this user's
    private directory, else the temporary directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _is_private_dir(Path(runtime), os.getuid()):
        return Path(runtime)
    return Path(tempfile.gettempdir())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(base: Path, uid: int) -> None:
    """Remove the secret directories of this user's processes that are gone."""
    with contextlib.suppress(OSError):
        for entry in base.iterdir():
            match = _DIR_NAME.fullmatch(entry.name)
            if match is None or int(match["uid"]) != uid or _pid_alive(int(match["pid"])):
                continue
            try:
                fd = os.open(entry, _DIR_FLAGS)
            except OSError:
                continue
            try:
                info = os.fstat(fd)
                if info.st_uid != uid:
                    continue  # not ours: a name another user chose to look like ours
                with contextlib.suppress(OSError):
                    os.unlink(FILE_NAME, dir_fd=fd)
            finally:
                os.close(fd)
            with contextlib.suppress(OSError):
                entry.rmdir()


def _start_reaper(path: Path) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        logger.warning("no helper to remove %s should this process be killed: %s", path, exc)
        return None


def _draw_name(uid: int) -> str:
    """A fresh name for this process's secret directory, which nobody can guess."""
    return f"tensorpipe-backend-{uid}-{os.getpid()}-{os.urandom(16).hex()}"


def make_secret_file(secret: str) -> Path:
    """Write ``secret`` to a fresh private file (see the module docstring) and return its path;
    the path of the one this process made already for ``secret``, if it is still there.

    Raises:
        OSError: no private directory could be made in :func:`secret_base`.
    """
    with _made_lock:
        for made in _made.values():
            if made.secret == secret and made.pid == os.getpid() and made.path.is_file():
                return made.path
    base, uid = secret_base(), os.getuid()
    _sweep(base, uid)
    for _ in range(_MAX_DRAWS):
        directory = base / _draw_name(uid)
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue  # squatted, or a link: never used; draw another name
        break
    else:
        raise FileExistsError(f"{base}: {_MAX_DRAWS} fresh random names for a directory were all taken")
    fd = os.open(directory, _DIR_FLAGS)
    try:
        info = os.fstat(fd)
        if info.st_uid != uid or stat.S_IMODE(info.st_mode) & 0o077:
            raise PermissionError(f"{directory}: the directory just made is not private to uid {uid}")
        file_fd = os.open(FILE_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            os.write(file_fd, secret.encode())
        finally:
            os.close(file_fd)
    finally:
        os.close(fd)
    path = directory / FILE_NAME
    with _made_lock:
        _made[path] = _Made(path, secret, _start_reaper(path))
    return path


def forget_secret_file(path: Path) -> None:
    """Remove a file :func:`make_secret_file` made (no error if it is gone already)."""
    with _made_lock:
        made = _made.pop(path, None)
    if made is not None:
        made.remove()


def read_secret_file(path: Path) -> bytes:
    """The secret in ``path``, after checking it is a file this user's workers made.

    Raises:
        FileNotFoundError: there is no such file on this host.
        SecretFileError: the path or the file is not this user's own and private, or holds no secret.
    """
    uid = os.getuid()
    parent = path.parent
    match = _DIR_NAME.fullmatch(parent.name)
    if (
        not path.is_absolute()
        or path.name != FILE_NAME
        or match is None
        or int(match["uid"]) != uid
        or os.path.normpath(path) != str(path)
    ):
        raise SecretFileError(f"{str(path)!r} is not the path of a secret file of uid {uid}")
    if not parent.exists():
        raise FileNotFoundError(str(path))
    if os.path.realpath(parent) != str(parent) or not _is_private_dir(parent, uid):
        raise SecretFileError(
            f"{str(path)!r} is not in a private directory of uid {uid} reached without symlinks"
        )
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or stat.S_IMODE(info.st_mode) & 0o077:
            raise SecretFileError(f"{str(path)!r} is not a regular file of mode 0600 owned by uid {uid}")
        data = os.read(fd, _SECRET_HEX_CHARS + 1)
    finally:
        os.close(fd)
    try:
        if len(data) != _SECRET_HEX_CHARS:
            raise ValueError("wrong length")
        return bytes.fromhex(data.decode())
    except (ValueError, UnicodeDecodeError):
        raise SecretFileError(f"{str(path)!r} does not hold a secret of this backend") from None
