"""Dumps: one JSON file per rank for each failure a watch names.

A rank writes its recorder's records and its state (pending collectives,
where its threads are) to ``<dir>/<run>/rank-<rank>.json`` when a rank is
lost, when a desync is found and when a hang is reported; ``python -m
join_core.trace <dir>/<run>`` reads a job's dumps and prints the same
analysis. ``<dir>`` is ``$JOIN_CORE_DUMP_DIR``, or a directory of this user's
own under the temporary directory (mode 0700, never one that another user
made or a link points to); ``<run>`` is agreed on by the ranks through the
store (``$TORCHELASTIC_RUN_ID`` when torchrun set it).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from join_core.recorder import CollectiveRecorder

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["DUMP_DIR_VARIABLE", "dump_dir", "run_id", "write"]

#: The environment variable that chooses where dumps go.
DUMP_DIR_VARIABLE: Final = "JOIN_CORE_DUMP_DIR"
_RUN_BYTES: Final = 64


def dump_dir() -> Path:
    """Where this process writes dumps (made if missing)."""
    chosen = os.environ.get(DUMP_DIR_VARIABLE)
    if chosen:
        path = Path(chosen)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.gettempdir()) / f"join-core-dumps-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        # Made by someone else, or a link: never written through; a fresh one of our own instead.
        return Path(tempfile.mkdtemp(prefix="join-core-dumps-"))
    return path


def run_id(store: Store | None) -> str:
    """The name every rank of this job gives its run's folder of dumps
    (without a store, this rank's own proposal)."""
    proposed = os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    if store is None:
        return proposed
    compare_set: Any = store.compare_set  # returns the value in place after the call
    agreed = compare_set("join_core/dump_run", "", proposed)
    raw = agreed.decode("ascii", "replace") if isinstance(agreed, bytes) else str(agreed)
    safe = "".join(c for c in raw[:_RUN_BYTES] if c.isalnum() or c in "-_.")
    return safe.strip(".") or "run"


def write(
    run: str,
    rank: int,
    world_size: int,
    kind: str,
    message: str,
    state: dict[str, Any],
    recorder: CollectiveRecorder,
    extra: Mapping[str, Any],
) -> Path:
    """Write this rank's dump for a failure of ``kind`` ("lost", "desync", "hang"); its path."""
    folder = dump_dir() / run
    folder.mkdir(mode=0o700, exist_ok=True)
    content = {
        "version": 1,
        "rank": rank,
        "world_size": world_size,
        "kind": kind,
        "message": message,
        "state": state,
        "records": [r.as_dict() for r in recorder.records()],
        **extra,
    }
    path = folder / f"rank-{rank}.json"
    temporary = folder / f".rank-{rank}.json.{os.getpid()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(content, file, indent=1)
    os.replace(temporary, path)
    return path
