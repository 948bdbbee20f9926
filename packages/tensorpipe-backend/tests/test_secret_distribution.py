"""The job's secret without a token: never through the store in clear, readable only by this user."""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch._C._distributed_c10d import HashStore, TCPStore
from tpb_workers import CONTEXT, backend, free_port, options, spawned

from rpc_registry import init_rpc, shutdown
from tensorpipe_backend import get_current_agent
from tensorpipe_backend.auth import AuthenticationError, PeerIdentity, client_handshake
from tensorpipe_backend.secret import (
    AUTH_TOKEN_ENV,
    INSECURE_SECRET_KEY,
    SECRET_FILE_KEY,
    resolve_secret,
    secret_dir,
)

pytestmark = pytest.mark.timeout(90)

NOBODY = 65534
# What rpc_registry's rendezvous prefixes every key of the first session with.
SESSION = "rpc_session_1/"


def serve_without_token(
    name: str, rank: int, world_size: int, init_method: str, results: Any, done: Any, insecure: bool = False
) -> None:
    """Join a static group with no auth_token; report this worker's address; wait for ``done``."""
    os.environ.pop(AUTH_TOKEN_ENV, None)
    init_rpc(name, backend(), rank, world_size, options(init_method, auth_token=None, insecure=insecure))
    results.put((name, get_current_agent().address))
    done.wait(60)
    shutdown(graceful=False)


def _read_as_nobody(path: str) -> str:
    """Try to read ``path`` as uid nobody in a forked child; what it got, or the error's name."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, try, report, exit without cleanup handlers
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                with open(path, "rb") as file:
                    outcome = b"read:" + file.read(100)
            except OSError as exc:
                outcome = type(exc).__name__.encode()
            os.write(write_end, outcome)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        outcome_text = pipe.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return outcome_text


def _stolen_secrets(port: int) -> list[bytes]:
    """Everything an outsider who reaches the store can turn into a candidate secret."""
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    candidates: list[bytes] = []
    if store.check([SESSION + INSECURE_SECRET_KEY]):
        candidates.append(bytes.fromhex(store.get(SESSION + INSECURE_SECRET_KEY).decode()))
    if store.check([SESSION + SECRET_FILE_KEY]):
        path = json.loads(store.get(SESSION + SECRET_FILE_KEY))["path"]
        outcome = _read_as_nobody(path)
        assert not outcome.startswith("read:"), "uid nobody read the job's secret file"
        assert outcome == "PermissionError", outcome
    return candidates


def _authenticates(address: tuple[str, int], secret: bytes) -> bool:
    with socket.create_connection(address, timeout=10) as sock:
        try:
            client_handshake(sock, secret, PeerIdentity("s1", 1), None)
        except (AuthenticationError, EOFError, OSError):
            return False
    return True


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to uid nobody needs root")
def test_another_local_user_who_reads_the_store_cannot_authenticate() -> None:
    port = free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    results, done = CONTEXT.Queue(), CONTEXT.Event()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (serve_without_token, (f"s{rank}", rank, 2, init_method, results, done)) for rank in range(2)
    ]
    with spawned(targets) as workers:
        addresses = dict(results.get(timeout=40) for _ in range(2))
        try:
            candidates = _stolen_secrets(port)
            assert not [s for s in candidates if _authenticates(addresses["s0"], s)], (
                "a secret read from the store passed the handshake"
            )
            assert _read_as_nobody(str(secret_dir())) == "PermissionError"
        finally:
            done.set()
    assert [w.exitcode for w in workers] == [0, 0]


def test_insecure_true_publishes_the_secret_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    store = HashStore()
    with caplog.at_level("WARNING", logger="tensorpipe_backend.secret"):
        secret = resolve_secret(None, store, 0, True, 5.0, insecure=True)
    assert bytes.fromhex(store.get(INSECURE_SECRET_KEY).decode()) == secret
    assert "insecure=True" in caplog.text


def test_workers_of_one_user_and_host_find_the_same_secret_in_a_private_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    store = HashStore()
    made = resolve_secret(None, store, 0, True, 5.0)
    assert resolve_secret(None, store, 1, True, 5.0) == made
    assert not store.check([INSECURE_SECRET_KEY])
    path = Path(json.loads(store.get(SECRET_FILE_KEY))["path"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert made.hex() not in store.get(SECRET_FILE_KEY).decode()


def test_a_worker_on_another_host_is_told_how_to_pass_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    store = HashStore()
    store.set(SECRET_FILE_KEY, json.dumps({"path": str(secret_dir() / f"secret-1-{'0' * 32}"), "host": "h0"}))
    with pytest.raises(RuntimeError, match=f"does not exist on this host.*{AUTH_TOKEN_ENV}.*insecure=True"):
        resolve_secret(None, store, 1, True, 5.0)


@pytest.mark.parametrize(
    "published",
    [
        "not json",
        json.dumps({"path": "/etc/passwd", "host": "h0"}),
        json.dumps({"path": "/tmp/../etc/secret-1-" + "0" * 32, "host": "h0"}),
    ],
)
def test_a_forged_store_entry_is_refused(monkeypatch: pytest.MonkeyPatch, published: str) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    store = HashStore()
    store.set(SECRET_FILE_KEY, published)
    with pytest.raises(RuntimeError, match=AUTH_TOKEN_ENV):
        resolve_secret(None, store, 1, True, 5.0)


def test_a_secret_file_readable_by_others_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    store = HashStore()
    resolve_secret(None, store, 0, True, 5.0)
    path = Path(json.loads(store.get(SECRET_FILE_KEY))["path"])
    path.chmod(0o644)
    with pytest.raises(RuntimeError, match="mode 0600"):
        resolve_secret(None, store, 1, True, 5.0)


def test_files_of_dead_processes_are_swept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    child = CONTEXT.Process(target=os.getpid)
    child.start()
    child.join()
    assert child.pid is not None
    stale = secret_dir() / f"secret-{child.pid}-{'a' * 32}"
    stale.write_text("0" * 64)
    resolve_secret(None, HashStore(), 0, True, 5.0)
    assert not stale.exists()
