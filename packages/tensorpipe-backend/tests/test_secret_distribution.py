"""The job's secret without a token: never through the store in clear, readable only by this user."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch._C._distributed_c10d import HashStore, TCPStore
from tpb_workers import CONTEXT, backend, free_port, options, spawned, whoami

from rpc_registry import init_rpc, rpc_sync, shutdown
from tensorpipe_backend import get_current_agent, secret_file
from tensorpipe_backend.auth import AuthenticationError, PeerIdentity, client_handshake
from tensorpipe_backend.secret import (
    AUTH_TOKEN_ENV,
    INSECURE_SECRET_KEY,
    SECRET_FILE_KEY,
    resolve_secret,
)
from tensorpipe_backend.secret_file import secret_base

pytestmark = pytest.mark.timeout(90)

NOBODY = 65534
# What rpc_registry's rendezvous prefixes every key of the first session with.
SESSION = "rpc_session_1/"


@pytest.fixture(autouse=True)
def secret_files_go_with_each_test() -> Iterator[None]:
    """The files this process's secrets were written to are removed after each test (a worker's
    last until it exits), so the tests leave none behind."""
    yield
    secret_file._remove_all()


def serve_without_token(
    name: str, rank: int, world_size: int, init_method: str, results: Any, done: Any, insecure: bool = False
) -> None:
    """Join a static group with no auth_token; report this worker's address; wait for ``done``."""
    os.environ.pop(AUTH_TOKEN_ENV, None)
    init_rpc(name, backend(), rank, world_size, options(init_method, auth_token=None, insecure=insecure))
    results.put((name, get_current_agent().address))
    done.wait(60)
    shutdown(graceful=False)


def _as_nobody(action: Callable[[], bytes]) -> str:
    """Run ``action`` as uid nobody in a forked child; what it returned, or the error's name."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, act, report, exit without cleanup handlers
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                outcome = action()
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


def _read_as_nobody(path: str) -> str:
    """Try to read ``path`` as uid nobody; what it got, or the error's name."""

    def read() -> bytes:
        with open(path, "rb") as file:
            return b"read:" + file.read(100)

    return _as_nobody(read)


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
            path = json.loads(TCPStore("127.0.0.1", port, is_master=False).get(SESSION + SECRET_FILE_KEY))
            assert _read_as_nobody(str(Path(path["path"]).parent)) == "PermissionError"
        finally:
            done.set()
    assert [w.exitcode for w in workers] == [0, 0]


def _dir_of(pid: int) -> Path:
    """Where a secret directory of process ``pid`` of this user would be (its random part zeros)."""
    return secret_base() / f"tensorpipe-backend-{os.getuid()}-{pid}-{'0' * 32}"


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
    store.set(SECRET_FILE_KEY, json.dumps({"path": str(_dir_of(1) / "secret"), "host": "h0"}))
    with pytest.raises(RuntimeError, match=f"does not exist on this host.*{AUTH_TOKEN_ENV}.*insecure=True"):
        resolve_secret(None, store, 1, True, 5.0)


@pytest.mark.parametrize(
    "published",
    [
        "not json",
        json.dumps({"path": "/etc/passwd", "host": "h0"}),
        json.dumps({"path": "/tmp/../etc/secret-1-" + "0" * 32, "host": "h0"}),
        json.dumps(
            {"path": f"/tmp/../tmp/tensorpipe-backend-{os.getuid()}-1-{'0' * 32}/secret", "host": "h0"}
        ),
        json.dumps({"path": f"/tmp/tensorpipe-backend-{os.getuid() + 1}-1-{'0' * 32}/secret", "host": "h0"}),
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
    stale = _dir_of(child.pid)
    stale.mkdir(mode=0o700)
    (stale / "secret").write_text("0" * 64)
    resolve_secret(None, HashStore(), 0, True, 5.0)
    assert not stale.exists()


@pytest.fixture
def sticky_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh sticky, world-writable directory, as /tmp is, made the temporary directory."""
    base = Path(tempfile.mkdtemp())
    base.chmod(0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.setattr("tempfile.tempdir", None)
    yield base
    shutil.rmtree(base)


def _squat(path: Path, link_to: Path | None = None) -> None:
    """As uid nobody, take ``path`` (a directory of mode 0700, or a symlink to ``link_to``)."""

    def take() -> bytes:
        if link_to is None:
            path.mkdir(mode=0o700)
        else:
            path.symlink_to(link_to)
        return b"taken"

    assert _as_nobody(take) == "taken"


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to uid nobody needs root")
def test_a_job_starts_when_another_user_squatted_the_usual_secret_directory(
    monkeypatch: pytest.MonkeyPatch, sticky_tmp: Path
) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    base = sticky_tmp
    _squat(base / f"tensorpipe-backend-{os.getuid()}")
    store = HashStore()
    made = resolve_secret(None, store, 0, True, 5.0)
    assert resolve_secret(None, store, 1, True, 5.0) == made
    assert Path(json.loads(store.get(SECRET_FILE_KEY))["path"]).parent.parent == base


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to uid nobody needs root")
@pytest.mark.parametrize("as_link", [False, True])
def test_a_secret_is_never_written_through_a_name_another_user_took(
    monkeypatch: pytest.MonkeyPatch, sticky_tmp: Path, as_link: bool
) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    base = sticky_tmp
    target = base / "theirs"
    target.mkdir()
    target.chmod(0o777)
    # The attacker knows the next name drawn (as if it could guess it) and takes it first.
    names = iter(
        [f"tensorpipe-backend-{os.getuid()}-{os.getpid()}-{'1' * 32}", f"tensorpipe-backend-x-{'2' * 32}"]
    )
    monkeypatch.setattr(secret_file, "_draw_name", lambda uid: next(names))
    taken = base / f"tensorpipe-backend-{os.getuid()}-{os.getpid()}-{'1' * 32}"
    _squat(taken, target if as_link else None)
    store = HashStore()
    made = resolve_secret(None, store, 0, True, 5.0)
    path = Path(json.loads(store.get(SECRET_FILE_KEY))["path"])
    assert path.parent.name == f"tensorpipe-backend-x-{'2' * 32}"
    assert path.read_text() == made.hex()
    assert list(target.iterdir()) == []
    assert list(taken.iterdir()) == []


def make_secret_then_wait(paths: Any) -> None:
    """Make the job's secret file as rank 0 of a static group would, report its path, wait to be ended."""
    os.environ.pop(AUTH_TOKEN_ENV, None)
    store = HashStore()
    resolve_secret(None, store, 0, True, 5.0)
    paths.put(json.loads(store.get(SECRET_FILE_KEY))["path"])
    time.sleep(60)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_secret_file_goes_when_its_maker_is_ended_by_a_signal(sig: signal.Signals) -> None:
    paths = CONTEXT.Queue()
    with spawned([(make_secret_then_wait, (paths,))], timeout=10) as (maker,):
        path = Path(paths.get(timeout=30))
        assert path.exists()
        assert maker.pid is not None
        os.kill(maker.pid, sig)
        maker.join(10)
        deadline = time.monotonic() + 5
        while path.parent.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert maker.exitcode == -sig
    assert not path.exists()
    assert not path.parent.exists()


def dynamic_member_without_token(name: str, rank: int, init_method: str, results: Any, leave: Any) -> None:
    """Join a dynamic group with no token; report; call the other members when told to leave, then leave."""
    os.environ.pop(AUTH_TOKEN_ENV, None)
    try:
        init_rpc(name, backend(), rank, None, options(init_method, auth_token=None))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((name, f"{type(exc).__name__}: {exc}"))
        return
    results.put((name, "joined"))
    leave.wait(60)
    others = [i.name for i in get_current_agent().get_worker_infos() if i.name != name]
    results.put((name, sorted(rpc_sync(other, whoami) for other in others)))
    shutdown(graceful=True, timeout=30.0)


def test_a_dynamic_member_joins_after_the_secrets_maker_left() -> None:
    port = free_port()
    # The store outlives the workers, as a launcher's agent hosts it.
    store = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    init_method = f"tcp://127.0.0.1:{port}"
    results = CONTEXT.Queue()
    leave = {name: CONTEXT.Event() for name in ("a", "b", "c")}
    member = dynamic_member_without_token
    with spawned([(member, ("a", 1, init_method, results, leave["a"]))]) as (a,):
        assert results.get(timeout=40) == ("a", "joined")
        with spawned([(member, ("b", 2, init_method, results, leave["b"]))]):
            assert results.get(timeout=40) == ("b", "joined")
            leave["a"].set()
            assert results.get(timeout=40) == ("a", ["b"])
            a.join(30)
            assert a.exitcode == 0
            with spawned([(member, ("c", 3, init_method, results, leave["c"]))]):
                assert results.get(timeout=40) == ("c", "joined")
                leave["c"].set()
                assert results.get(timeout=40) == ("c", ["b"])
            leave["b"].set()
            assert results.get(timeout=40) == ("b", [])
    del store


def init_reporting_how_it_failed(
    name: str, rank: int, init_method: str, results: Any, insecure: bool, elsewhere: bool
) -> None:
    """Join a static group of 2 with no token; report how long init_rpc took and how it failed.
    ``elsewhere``: this worker finds no secret file, as on another host."""
    os.environ.pop(AUTH_TOKEN_ENV, None)
    if elsewhere:

        def not_on_this_host(path: Path) -> bytes:
            raise FileNotFoundError(str(path))

        import tensorpipe_backend.secret

        setattr(tensorpipe_backend.secret, "read_secret_file", not_on_this_host)  # noqa: B010 - patched in this process
    started = time.monotonic()
    try:
        init_rpc(name, backend(), rank, 2, options(init_method, auth_token=None, insecure=insecure))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, time.monotonic() - started, f"{type(exc).__name__}: {exc}"))
        return
    results.put((rank, time.monotonic() - started, "joined"))
    shutdown(graceful=False)


@pytest.mark.parametrize(
    ("insecure", "elsewhere", "cause"),
    [
        ((False, False), (False, True), "does not exist on this host"),
        ((True, False), (False, False), "insecure"),
        ((False, True), (False, False), "insecure"),
    ],
    ids=["rank1-on-another-host", "insecure-on-rank0-only", "insecure-on-rank1-only"],
)
def test_a_worker_that_cannot_get_the_secret_fails_fast_on_both_sides_naming_the_cause(
    insecure: tuple[bool, bool], elsewhere: tuple[bool, bool], cause: str
) -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (init_reporting_how_it_failed, (f"f{r}", r, init_method, results, insecure[r], elsewhere[r]))
        for r in range(2)
    ]
    with spawned(targets):
        outcomes = sorted(results.get(timeout=60) for _ in range(2))
    for rank, elapsed, error in outcomes:
        assert cause in error, (rank, error)
        assert elapsed < 8, f"rank {rank} took {elapsed:.1f} s of its 20 s timeout to fail: {error}"
    assert "rank 1 could not join" in outcomes[0][2]


def test_a_forked_child_that_exits_leaves_its_parents_secret_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    store = HashStore()
    resolve_secret(None, store, 0, True, 5.0)
    path = Path(json.loads(store.get(SECRET_FILE_KEY))["path"])
    pid = os.fork()
    if pid == 0:  # the child exits as a script does, running its exit handlers
        try:
            secret_file._remove_all()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert path.exists()


def _files_and_helpers() -> tuple[list[Path], list[Any]]:
    """The secret files this process made and still keeps, and their removal helpers still running."""
    made = list(secret_file._made.values())
    return [m.path for m in made if m.path.exists()], [
        m.reaper for m in made if m.reaper and m.reaper.poll() is None
    ]


def _static_solo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    init_rpc("solo", backend(), 0, 1, options(f"tcp://127.0.0.1:{free_port()}", auth_token=None))


def test_a_static_groups_secret_file_and_its_helper_go_with_the_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for _ in range(2):
        _static_solo(monkeypatch)
        files, helpers = _files_and_helpers()
        assert len(files) == 1 and len(helpers) == 1
        shutdown(graceful=True, timeout=10.0)
        assert not files[0].exists()
        helpers[0].wait(timeout=5)
        assert _files_and_helpers() == ([], [])


def test_an_init_rpc_that_fails_leaves_no_secret_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(records: Any) -> None:
        raise ValueError("unreachable, as a later step of init_rpc may fail")

    monkeypatch.setattr("tensorpipe_backend.agent.check_reachable", unreachable)
    for world_size in (1, None):  # static, dynamic
        monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        with pytest.raises(ValueError, match="unreachable"):
            init_rpc("solo", backend(), 0, world_size, options(init_method, auth_token=None))
        files, _ = _files_and_helpers()
        assert files == [], world_size


def test_a_dynamic_member_joining_again_keeps_one_copy_of_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    seen = set()
    for _ in range(3):
        init_rpc("d", backend(), 0, None, options(init_method, auth_token=None))
        try:
            files, helpers = _files_and_helpers()
            seen.update(files)
            assert len(files) == 1 and len(helpers) == 1
        finally:
            shutdown(graceful=True, timeout=10.0)
    assert len(seen) == 1
