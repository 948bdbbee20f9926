"""init_rpc's argument checks, rendezvous methods and timeout meaning, in one process."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rpcreg_socket_agent import SocketOptions, Tracked, sleep_then, socket_backend

from rpc_registry import (
    RpcBackendOptions,
    RRef,
    WorkerInfo,
    backend_registered,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)

pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def tcp() -> str:
    return f"tcp://127.0.0.1:{_free_port()}"


@pytest.fixture
def solo(tcp: str) -> Iterator[None]:
    """A one-worker session whose agent default timeout is 0.3 s."""
    options = SocketOptions(rpc_timeout=0.3, init_method=tcp)
    init_rpc("solo", backend=socket_backend(), rank=0, world_size=1, rpc_backend_options=options)
    yield
    shutdown(timeout=10.0)


@pytest.mark.parametrize("name", ["has space", "", "a" * 128, "é"])
def test_init_rpc_rejects_invalid_worker_name(name: str) -> None:
    with pytest.raises(ValueError, match=r"name=.*letter, digit, '_', ':' or '-'"):
        init_rpc(name, backend=socket_backend(), rank=0, world_size=1)


def test_init_rpc_rejects_backend_that_is_not_a_member() -> None:
    # torch's wording, then the value.
    match = r"Argument backend must be a member of BackendType: backend='SOCKET_TEST'"
    with pytest.raises(TypeError, match=match):
        init_rpc("w0", backend="SOCKET_TEST", rank=0, world_size=1)  # type: ignore[arg-type]


def test_init_rpc_rejects_options_without_timeout_and_init_method() -> None:
    match = (
        r"Argument rpc_backend_options must be an instance of RpcBackendOptions .*rpc_backend_options=\{\}"
    )
    with pytest.raises(TypeError, match=match):
        init_rpc("w0", backend=socket_backend(), rpc_backend_options={})  # type: ignore[arg-type]


def test_init_rpc_rejects_rank_outside_world_size() -> None:
    with pytest.raises(ValueError, match=r"rank=2: must be below world_size=2"):
        init_rpc("w0", backend=socket_backend(), rank=2, world_size=2)


@pytest.mark.parametrize("given", ["env", "url"])
def test_init_rpc_rejects_a_rank_from_the_environment_or_url_outside_world_size(
    given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if given == "env":
        monkeypatch.setenv("RANK", "5")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        url, world_size = "env://", None
    else:
        url, world_size = f"tcp://127.0.0.1:{_free_port()}?rank=5", 2
    options = SocketOptions(rpc_timeout=5.0, init_method=url)
    with pytest.raises(
        ValueError, match=r"^rank=5: must be below world_size=2 .*rank from 0 to world_size - 1"
    ):
        init_rpc("w5", backend=socket_backend(), world_size=world_size, rpc_backend_options=options)


def test_init_rpc_rejects_non_positive_world_size() -> None:
    with pytest.raises(ValueError, match=r"world_size=0"):
        init_rpc("w0", backend=socket_backend(), rank=0, world_size=0)


def test_init_rpc_without_installed_backend_says_which_to_install() -> None:
    if backend_registered("TENSORPIPE"):
        pytest.skip("a TENSORPIPE backend is installed in this environment")
    with pytest.raises(RuntimeError, match=r"pip install tensorpipe-backend") as raised:
        init_rpc("w0", rank=0, world_size=1)
    # PyPI, a checkout, and where the other ways are written down
    assert "pip install ./packages/rpc-registry ./packages/tensorpipe-backend" in str(raised.value)
    assert "#install" in str(raised.value)


def test_init_rpc_rejects_options_no_backend_builds() -> None:
    class ForeignOptions:
        rpc_timeout = 1.0
        init_method = "env://"

    with pytest.raises(TypeError, match=r"no registered backend builds options of type .*ForeignOptions"):
        init_rpc("w0", rank=0, world_size=1, rpc_backend_options=ForeignOptions())


def test_rpc_before_init_raises_torchs_errors_saying_to_call_init_rpc() -> None:
    with pytest.raises(
        RuntimeError, match=r"^RPC has not been initialized: call rpc_registry.init_rpc\(\) first"
    ):
        rpc_sync("w1", sleep_then, args=(0, 1))
    with pytest.raises(
        RuntimeError, match=r"^Current RPC agent is not set! .* Call rpc_registry.init_rpc\(\) first"
    ):
        RRef(torch.ones(1))


def test_init_rpc_infers_backend_from_options_over_env_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    socket_backend()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    init_rpc("envworker", rpc_backend_options=SocketOptions(rpc_timeout=5.0, init_method="env://"))
    try:
        assert get_worker_info() == WorkerInfo("envworker", 0)
        assert rpc_sync("envworker", os.getpid) == os.getpid()
    finally:
        shutdown(timeout=10.0)


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'rendezvous'}"


@pytest.mark.parametrize("url", ["tcp", "file_url"])
def test_dynamic_group_starts_without_world_size(url: str, request: pytest.FixtureRequest) -> None:
    options = SocketOptions(rpc_timeout=5.0, init_method=request.getfixturevalue(url))
    init_rpc("dyn", backend=socket_backend(), rank=0, world_size=None, rpc_backend_options=options)
    try:
        assert rpc_sync("dyn", sleep_then, args=(0, 3)) == 3
    finally:
        shutdown(timeout=10.0)


def test_env_rendezvous_without_rank_says_rank_is_expected(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    options = SocketOptions(rpc_timeout=5.0, init_method="env://")
    with pytest.raises(ValueError, match=r"^environment variable RANK expected: rank=-1"):
        init_rpc("dyn", backend=socket_backend(), world_size=None, rpc_backend_options=options)


@pytest.mark.parametrize("url", ["tcp", "file_url"])
def test_dynamic_group_needs_a_rank(url: str, request: pytest.FixtureRequest) -> None:
    options = SocketOptions(rpc_timeout=5.0, init_method=request.getfixturevalue(url))
    with pytest.raises(ValueError, match=r"^rank parameter missing: rank=-1: a dynamic group"):
        init_rpc("dyn", backend=socket_backend(), world_size=None, rpc_backend_options=options)


@pytest.mark.usefixtures("solo")
def test_timeout_minus_one_means_the_agent_default() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no reply within 0.3 s"):
        rpc_sync("solo", sleep_then, args=(1.0, 1))
    assert time.monotonic() - start < 0.9


@pytest.mark.usefixtures("solo")
def test_timeout_zero_means_no_timeout() -> None:
    assert rpc_sync("solo", sleep_then, args=(0.5, 2), timeout=0) == 2


@pytest.mark.usefixtures("solo")
def test_timeout_infinity_means_no_timeout_and_later_timeouts_still_fire() -> None:
    assert rpc_sync("solo", sleep_then, args=(0.5, 3), timeout=float("inf")) == 3
    assert remote("solo", sleep_then, args=(0.0, 4), timeout=1e300).to_here(timeout=float("inf")) == 4
    with pytest.raises(TimeoutError, match=r"no reply within 0.1 s"):
        rpc_sync("solo", sleep_then, args=(1.0, 5), timeout=0.1)


@pytest.mark.usefixtures("solo")
@pytest.mark.parametrize(
    ("timeout", "error"),
    [("5", TypeError), (None, TypeError), (True, TypeError), (float("nan"), ValueError), (-2, ValueError)],
)
def test_a_timeout_that_is_not_seconds_is_refused_at_the_call_naming_it(timeout: Any, error: type) -> None:
    match = r"^timeout=.*: must be seconds .*0 waiting without limit, or -1 for the agent's default"
    with pytest.raises(error, match=match):
        rpc_sync("solo", sleep_then, args=(0.0, 1), timeout=timeout)
    with pytest.raises(error, match=match):
        rpc_async("solo", sleep_then, args=(0.0, 1), timeout=timeout)
    with pytest.raises(error, match=match):
        remote("solo", sleep_then, args=(0.0, 1), timeout=timeout)
    with pytest.raises(error, match=r"^timeout=.*: must be seconds"):
        shutdown(timeout=timeout)
    assert rpc_sync("solo", sleep_then, args=(0.0, 6)) == 6  # the refused shutdown left it running


@pytest.mark.usefixtures("solo")
@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (torch.ones(2), None, r"^args=tensor\(\[1., 1.\]\) \(Tensor\): must be a tuple .* args=\(x,\)"),
        ("ab", None, r"^args='ab' \(str\): must be a tuple"),
        ((0.0, 1), [("value", 1)], r"^kwargs=\[\('value', 1\)\] \(list\): must be a dict"),
    ],
)
def test_arguments_that_are_not_a_tuple_and_a_dict_are_refused_at_the_call(
    args: Any, kwargs: Any, match: str
) -> None:
    for call in (rpc_sync, rpc_async, remote):
        with pytest.raises(TypeError, match=match):
            call("solo", sleep_then, args=args, kwargs=kwargs)
    listed: Any = [0.0, 7]
    assert rpc_sync("solo", sleep_then, args=listed) == 7  # a list is taken as the tuple it holds


@pytest.mark.usefixtures("solo")
def test_remote_to_self_gives_an_owner_rref() -> None:
    rref: RRef[Tracked] = remote("solo", Tracked, args=(8,))
    assert rref.is_owner() and rref.confirmed_by_owner()
    assert rref.local_value().value == 8 and rref.to_here().value == 8


def test_shutdown_allows_a_new_session(tcp: str) -> None:
    options = SocketOptions(rpc_timeout=5.0, init_method=tcp)
    init_rpc("first", backend=socket_backend(), rank=0, world_size=1, rpc_backend_options=options)
    shutdown(timeout=10.0)
    with pytest.raises(RuntimeError, match="init_rpc"):
        get_worker_info()
    options = SocketOptions(rpc_timeout=5.0, init_method=f"tcp://127.0.0.1:{_free_port()}")
    init_rpc("second", backend=socket_backend(), rank=0, world_size=1, rpc_backend_options=options)
    try:
        assert get_worker_info().name == "second"
    finally:
        shutdown(timeout=10.0)


def test_a_dynamic_group_is_one_session_for_every_worker_that_joins_its_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rpc_registry.rendezvous import rendezvous_store

    url = f"file://{tmp_path / 'store'}"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    first, _, _ = rendezvous_store(url, 1, None, 5.0, timeout=10.0)
    first.set("member", "w")
    # The same rank again (a new process taking it, or this one after leaving), and another rank.
    for rank in (1, 1, 2):
        again, _, _ = rendezvous_store(url, rank, None, 5.0, timeout=10.0)
        assert again.check(["member"]), f"rank {rank} came to another session"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun started every worker again
    restarted, _, _ = rendezvous_store(url, 1, None, 5.0, timeout=10.0)
    assert not restarted.check(["member"])


def test_each_start_of_a_static_group_is_a_session_of_its_own(tmp_path: Path) -> None:
    from rpc_registry.rendezvous import rendezvous_store

    url = f"file://{tmp_path / 'store'}"
    first, _, _ = rendezvous_store(url, 0, 1, 5.0, timeout=10.0)
    first.set("member", "w")
    again, _, _ = rendezvous_store(url, 0, 1, 5.0, timeout=10.0)
    assert not again.check(["member"])


def test_rank_above_zero_waits_for_the_store_to_listen_then_connects() -> None:
    from rpc_registry.rendezvous import _await_store

    port = _free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.3)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    opener = threading.Thread(target=listen_later)
    opener.start()
    try:
        assert _await_store("127.0.0.1", port, timeout=20.0)
        # It returned because the address accepts connections now, not by giving up.
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        opener.join()
        listener.close()


def test_waiting_for_the_store_gives_up_after_its_timeout() -> None:
    from rpc_registry.rendezvous import _await_store

    start = time.monotonic()
    assert not _await_store("127.0.0.1", _free_port(), timeout=0.2)  # nothing listens there
    assert time.monotonic() - start >= 0.2


def test_init_rpc_names_the_rank_that_never_arrives_within_the_rendezvous_timeout(tcp: str) -> None:
    options = SocketOptions(rpc_timeout=0.5, init_method=tcp, rendezvous_timeout=2.0)
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"waited \d+\.\d s for all 3 workers.*ranks 1, 2 never arrived"
    ) as raised:
        init_rpc("lonely", backend=socket_backend(), rank=0, world_size=3, rpc_backend_options=options)
    assert 2.0 <= time.monotonic() - start < 3.0
    # The only exception Python prints: not under the store's own timeout and its traceback.
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_init_rpc_on_a_port_another_program_listens_on_fails_within_rpc_timeout_naming_it() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()  # accepts connections (the backlog), never answers
        port = busy.getsockname()[1]
        options = SocketOptions(rpc_timeout=2.0, init_method=f"tcp://127.0.0.1:{port}")
        start = time.monotonic()
        for rank in (0, 1):
            with pytest.raises(TimeoutError, match=rf"rendezvous store at 127\.0\.0\.1:{port} "):
                init_rpc("w", backend=socket_backend(), rank=rank, world_size=2, rpc_backend_options=options)
        assert time.monotonic() - start < 8.0
    for thread in threading.enumerate():  # the client left waiting gives up once the port closed
        if thread.name.startswith("rpc_registry store client"):
            thread.join(timeout=30)


def test_init_rpc_without_a_store_host_fails_within_the_rendezvous_timeout() -> None:
    options = SocketOptions(
        rpc_timeout=0.5, init_method=f"tcp://127.0.0.1:{_free_port()}", rendezvous_timeout=2.0
    )
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="could not reach the rendezvous store"):
        init_rpc("orphan", backend=socket_backend(), rank=1, world_size=2, rpc_backend_options=options)
    assert 2.0 <= time.monotonic() - start < 3.0


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), True, "60"])
def test_init_rpc_rejects_a_rendezvous_timeout_that_is_not_positive_seconds(
    tcp: str, timeout: object
) -> None:
    options = SocketOptions(rpc_timeout=0.5, init_method=tcp, rendezvous_timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rendezvous_timeout=.*must be seconds > 0"):
        init_rpc("odd", backend=socket_backend(), rank=0, world_size=1, rpc_backend_options=options)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
def test_the_store_of_a_tcp_rendezvous_listens_on_the_urls_ipv4_address_only() -> None:
    # On every interface, peers on 127.0.0.1 would arrive as ::ffff:127.0.0.1, whose reverse
    # lookup by the store goes to DNS (and stalled init_rpc 5 s when a reply was lost).
    from rpc_registry.rendezvous import rendezvous_store

    port = _free_port()
    store, _, _ = rendezvous_store(f"tcp://127.0.0.1:{port}", 0, 1, 10.0)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("::1", port), timeout=5).close()
    store.set("key", "value")
    assert store.get("key") == b"value"


class _FileOptions(RpcBackendOptions):
    """A user's options class, shaped as torch's suites write theirs."""

    def __init__(self, init_method: str) -> None:
        RpcBackendOptions.__init__(self)
        self.init_method = init_method


def test_a_subclass_of_rpc_backend_options_setting_init_method_starts_rpc(tmp_path: Path) -> None:
    options = _FileOptions(f"file://{tmp_path / 'store'}")
    assert (options.rpc_timeout, isinstance(options, RpcBackendOptions)) == (60.0, True)
    init_rpc("sub", backend=socket_backend(), rank=0, world_size=1, rpc_backend_options=options)
    try:
        assert rpc_sync("sub", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
    finally:
        shutdown(timeout=10.0)


def test_options_of_no_backend_without_backend_say_it_cannot_be_inferred(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="Could not infer backend for options"):
        init_rpc("foo", rank=0, world_size=1, rpc_backend_options=_FileOptions(f"file://{tmp_path / 's'}"))


def test_a_lone_rank_fails_within_its_rendezvous_timeout_and_one_second() -> None:
    options = SocketOptions(
        rpc_timeout=0.5, init_method=f"tcp://127.0.0.1:{_free_port()}", rendezvous_timeout=5.0
    )
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"after \d\.\d s of at most 5 s"):
        init_rpc("alone", backend=socket_backend(), rank=1, world_size=2, rpc_backend_options=options)
    assert time.monotonic() - start <= 6.0
