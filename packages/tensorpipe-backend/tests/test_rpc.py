"""Calls, nesting, errors, timeouts and RRefs in a static group of three processes.

This process is w0; w1 and w2 are spawned. The group uses a known secret so
that the security tests can also act as a client that holds it.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tpb_workers import (
    NOTED,
    TOKEN,
    SlowToLoad,
    add,
    add_ignoring,
    address,
    armed_payload,
    ask_back,
    async_double,
    describe,
    echo_flood,
    flood,
    free_port,
    nested_add_one,
    options,
    peer_transports,
    pid,
    raise_key_error,
    remote_pair_on,
    return_an_rref_of,
    send_to_owner_then_drop,
    serve,
    set_stuck_ticks,
    sleep_then,
    spawned,
    whoami,
)

from rpc_registry import RRef, WorkerInfo, get_worker_info, init_rpc, remote, rpc_async, rpc_sync, shutdown
from tensorpipe_backend import TensorPipeAgent, ensure_registered, get_current_agent
from tensorpipe_backend.auth import AuthenticationError, HandshakeStatus, PeerIdentity, client_handshake
from tensorpipe_backend.calls import Reply
from tensorpipe_backend.wire import HEADER, Kind, encode_header

# Called with arguments they do not take, on purpose.
UNTYPED_ADD: Callable[..., Any] = torch.add

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    targets = [(serve, (f"w{rank}", rank, 3, init_method)) for rank in (1, 2)]
    with spawned(targets) as workers:
        init_rpc("w0", ensure_registered(), 0, 3, options(init_method))
        try:
            yield
        finally:
            shutdown(graceful=True, timeout=30.0)
    assert [w.exitcode for w in workers] == [0, 0]


def test_oversized_frame_from_a_member_closes_only_that_connection() -> None:
    """A member (w1 and w2 have not connected yet) sending a frame beyond the bounds is cut off."""
    w1 = rpc_sync("w1", address)
    with socket.create_connection(w1, timeout=5) as sock:
        _, status = client_handshake(sock, TOKEN.encode(), PeerIdentity("w2", 2), PeerIdentity("w1", 1))
        assert status is HandshakeStatus.ACCEPTED
        sock.sendall(struct.pack("!4sB3xQIII", b"TPB1", 1, 9, 0xFFFFFFFF, 0, 0))
        assert _closed_by_peer(sock)
    assert rpc_sync("w1", sleep_then, args=(0.0, 3)) == 3
    assert rpc_sync("w2", nested_add_one, args=("w1", torch.zeros(1))).item() == 2.0


def test_rpc_sync_moves_tensors_and_kwargs() -> None:
    x, y = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)
    assert torch.equal(rpc_sync("w1", add, args=(x, y), kwargs={"scale": 2.0}), (x + y) * 2)


def test_rpc_async_future_holds_the_result_from_another_process() -> None:
    futures = [rpc_async(name, pid) for name in ("w1", "w2")]
    pids = [f.wait() for f in futures]
    assert len(set(pids)) == 2 and all(isinstance(p, int) for p in pids)


def test_tensor_dtype_shape_grad_and_layout_survive_the_trip() -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    view = base.t()[1:4]
    # A non-contiguous view keeps its strides, as with torch's agent.
    assert rpc_sync("w1", describe, args=(view,)) == ("torch.float64", [3, 4], False, False)
    assert torch.equal(rpc_sync("w1", torch.clone, args=(view,)), view)
    grad = torch.ones(3, requires_grad=True)
    assert rpc_sync("w1", describe, args=(grad,))[3] is True
    for tensor in (torch.tensor([True, False]), torch.zeros(0, 5), torch.tensor(3, dtype=torch.int8)):
        assert torch.equal(rpc_sync("w2", torch.clone, args=(tensor,)), tensor)


def test_a_parameter_arrives_as_a_parameter_as_with_torchs_agent() -> None:
    module = rpc_sync("w1", torch.nn.Linear, args=(3, 2))
    assert type(module.weight) is torch.nn.Parameter and module.weight.requires_grad
    torch.nn.Linear(3, 2).weight = module.weight  # what a module takes only from a Parameter
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    assert rpc_sync("w2", type, args=(frozen,)) is torch.nn.Parameter
    assert rpc_sync("w2", describe, args=(frozen,))[3] is False


def test_large_tensor_arrives_intact() -> None:
    big = torch.randn(4_000_000)
    assert torch.equal(rpc_sync("w1", torch.neg, args=(big,)), -big)


def test_large_replies_kept_alive_are_never_overwritten_by_later_ones() -> None:
    big = torch.randn(2_000_000)
    first = rpc_sync("w1", torch.add, args=(big, 1))
    second = rpc_sync("w1", torch.add, args=(big, 2))
    del second
    third = rpc_sync("w1", torch.add, args=(big, 3))
    fourth = rpc_sync("w1", torch.add, args=(big, 4))
    assert torch.equal(first, big + 1) and torch.equal(third, big + 3) and torch.equal(fourth, big + 4)


def test_sync_calls_read_their_shared_memory_replies_in_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No hand-over from the reader thread (one thread wake-up less per call) when the reply's
    tensors come through shared memory."""
    setters: list[int] = []
    original = Reply.set

    def recording(self: Reply, outcome: Any) -> None:
        setters.append(threading.get_ident())
        original(self, outcome)

    monkeypatch.setattr(Reply, "set", recording)
    big = torch.randn(1 << 19)  # 2 MiB: through shared memory
    for _ in range(20):
        assert torch.equal(rpc_sync("w1", torch.neg, args=(big,)), -big)
    assert len(setters) == 20
    # A reply that arrives before the caller looks is the reader thread's: most, not all, are here.
    assert setters.count(threading.get_ident()) >= 1


def test_nested_call_reaches_a_third_worker() -> None:
    x = torch.ones(3)
    assert torch.equal(rpc_sync("w1", nested_add_one, args=("w2", x)), (x + 1) * 2)


def test_call_back_to_the_caller_from_within_a_call() -> None:
    # w1 runs the call on the thread that reads w0's socket; w0's reply to the inner call must still be read.
    x = torch.ones(3)
    assert torch.equal(rpc_sync("w1", nested_add_one, args=("w0", x), timeout=10), (x + 1) * 2)


def test_a_slow_call_does_not_hold_up_the_next_one_from_the_same_worker() -> None:
    slow = rpc_async("w1", sleep_then, args=(2.0, 1))
    start = time.monotonic()
    assert rpc_sync("w1", sleep_then, args=(0.0, 2)) == 2
    assert time.monotonic() - start < 1.0
    assert slow.wait() == 1


def test_workers_on_one_host_talk_over_unix_sockets() -> None:
    rpc_sync("w2", pid)
    assert get_current_agent().peer_transports == {"w1": "unix", "w2": "unix"}
    assert rpc_sync("w1", peer_transports)["w0"] == "unix"


def test_async_execution_function_replies_later() -> None:
    result: Any = rpc_sync("w2", async_double, args=("w1", torch.zeros(2)))
    assert torch.equal(result, torch.full((2,), 2.0))


def test_remote_exception_keeps_type_message_and_remote_traceback() -> None:
    with pytest.raises(KeyError, match="missing-key") as info:
        rpc_sync("w2", raise_key_error, args=("missing-key",))
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "Raised on the remote worker" in notes and "raise_key_error" in notes


def test_torch_operator_with_no_matching_schema_raises_torchs_runtime_error() -> None:
    with pytest.raises(
        RuntimeError, match=r"^Overloaded torch operator invoked from Python failed to match any schema"
    ):
        rpc_sync("w1", UNTYPED_ADD, args=())


def test_timed_out_call_raises_and_the_agent_keeps_working() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"0\.3 s"):
        rpc_sync("w1", sleep_then, args=(2.0, 1), timeout=0.3)
    assert time.monotonic() - start < 1.5
    assert rpc_sync("w1", sleep_then, args=(0.0, 5)) == 5
    assert rpc_sync("w1", sleep_then, args=(0.2, 6), timeout=0) == 6


@pytest.mark.parametrize(
    ("to", "tensor"), [("w1", False), ("w1", True), ("w0", False)], ids=["plain", "with-a-tensor", "to-self"]
)
def test_a_timed_out_calls_callback_may_wait_for_another_call_that_times_out(to: str, tensor: bool) -> None:
    # torch runs a future's callbacks on the thread that completes it: a timeout's must not be
    # the thread that times every call out, or the inner call below would never time out.
    arg: Any = torch.ones(1) if tensor else 1
    outcome: list[str] = []
    done = threading.Event()

    def retry(_: object) -> None:
        try:
            rpc_sync(to, sleep_then, args=(3.0, arg), timeout=0.3)
            outcome.append("returned")
        except TimeoutError:
            outcome.append("timed out")
        finally:
            done.set()

    rpc_async(to, sleep_then, args=(3.0, arg), timeout=0.3).add_done_callback(retry)
    assert done.wait(10), "the inner call never timed out"
    assert outcome == ["timed out"]
    time.sleep(3)  # the handlers end before the next test


def test_sync_calls_from_many_threads_each_get_their_own_reply() -> None:
    # One waiting thread at a time reads the socket and hands the others their replies.
    def calls(base: int) -> list[int]:
        return [rpc_sync("w1", sleep_then, args=(0.0, base + i)) for i in range(40)]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(calls, range(0, 800, 100)))
    assert results == [list(range(base, base + 40)) for base in range(0, 800, 100)]


def test_requests_that_arrive_while_the_caller_waits_run_on_worker_threads() -> None:
    # w1 calls back while w0's main thread waits for (and reads) the outer reply.
    answers = rpc_sync("w1", ask_back, args=("w0", 5), timeout=20)
    assert [value for value, _ in answers] == list(range(5))
    assert all(name != threading.main_thread().name for _, name in answers), answers


def test_an_interrupted_sync_call_leaves_the_connection_working() -> None:
    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            rpc_sync("w2", sleep_then, args=(0.6, 1))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert [rpc_sync("w2", sleep_then, args=(0.0, i)) for i in range(20)] == list(range(20))
    time.sleep(0.6)  # the interrupted call's late reply arrives and is dropped
    assert rpc_sync("w2", sleep_then, args=(0.0, 21)) == 21
    assert get_current_agent().peer_transports["w2"] == "unix"


def test_signals_that_raise_during_sync_calls_lose_no_incoming_call() -> None:
    # w1 floods w0 while a timer interrupts w0's main thread, mostly within rpc_sync.
    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    NOTED.clear()
    flooding = rpc_async("w1", flood, args=("w0", 1000), timeout=40)
    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupted, rng = 0, random.Random(0)
    try:
        while not flooding.done():
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(5e-5, 2e-3))
                rpc_sync("w1", sleep_then, args=(0.0, 1), timeout=5)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except Interrupted:
                interrupted += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted > 0
    assert flooding.wait() == list(range(1000))
    assert list(range(1000)) == NOTED
    assert rpc_sync("w1", sleep_then, args=(0.0, 2), timeout=5) == 2
    deadline = time.monotonic() + 5
    while get_current_agent()._active() and time.monotonic() < deadline:
        time.sleep(0.01)  # late replies of interrupted calls arrive and are dropped
    assert get_current_agent()._active() == 0


def test_two_workers_flooding_each_other_with_calls_never_deadlock() -> None:
    # Each side's reader answers the other's calls while both sockets' buffers are full: a reader
    # that waited to send its reply would stop reading, and so would the peer's.
    crossing = rpc_async("w1", echo_flood, args=("w0", 64, 60_000), timeout=40)
    assert echo_flood("w1", 64, 60_000) == 64
    assert crossing.wait() == 64
    assert rpc_sync("w1", sleep_then, args=(0.0, 3), timeout=5) == 3


def test_crossing_replies_too_large_to_post_never_deadlock_even_without_the_watch() -> None:
    # A reply over 16 MiB inline leaves from the answering reader itself, which waits for the peer
    # to read it, as the peer's reader may for its own: each hands its reading to another thread
    # first, not only when the watch relieves it. With the watch off, only that keeps both reading.
    ticks = rpc_sync("w1", set_stuck_ticks, args=(1 << 30,))
    assert set_stuck_ticks(1 << 30) == ticks
    try:
        crossing = rpc_async("w1", echo_flood, args=("w0", 3, 20_000_000), timeout=40)
        assert echo_flood("w1", 3, 20_000_000) == 3
        assert crossing.wait() == 3
    finally:
        set_stuck_ticks(ticks)
        rpc_sync("w1", set_stuck_ticks, args=(ticks,))


def test_calls_from_one_worker_are_handled_in_order() -> None:
    futures = [rpc_async("w2", sleep_then, args=(0.0, i)) for i in range(50)]
    assert [f.wait() for f in futures] == list(range(50))


def test_rref_value_lives_on_its_owner() -> None:
    rref: RRef[torch.Tensor] = remote("w1", torch.ones, args=([2],))
    assert rref.owner() == WorkerInfo("w1", 1)
    assert torch.equal(rref.to_here(), torch.ones(2))
    assert torch.equal(rpc_sync("w2", RRef.to_here, args=(rref,)), torch.ones(2))


def test_rrefs_forked_before_their_owner_confirmed_them_stay_valid() -> None:
    # w1 sends w0 forks of RRefs whose creation requests to w2 may not have been handled yet.
    outer = [remote("w1", remote_pair_on, args=("w2",)) for _ in range(3)]
    for rref in outer:
        first, second = rref.to_here()
        assert torch.equal(first.to_here(), torch.full((2,), 2.0))
        assert torch.equal(second.to_here(), torch.full((2,), 3.0))


def test_rref_sent_to_its_owner_before_the_owner_created_it() -> None:
    # w2 may still unpickle the creation when the call carrying the RRef arrives.
    rref = remote("w2", add_ignoring, args=(torch.ones(2), 1, SlowToLoad(0.2)))
    assert torch.equal(rpc_sync("w2", RRef.to_here, args=(rref,)), torch.full((2,), 2.0))


def test_rref_sent_to_its_owner_then_dropped_by_the_sender() -> None:
    # w1's deletion of its only reference must not overtake the call that carries it to w2.
    assert torch.equal(rpc_sync("w1", send_to_owner_then_drop, args=("w2",)), torch.ones(2))


def test_rref_returned_to_its_owner_outlives_the_callees_reference() -> None:
    # w1's deletion of its reference must not overtake w0's unpickling of the reply carrying it.
    _, rref = rpc_sync("w1", return_an_rref_of, args=("w0",))
    assert rref.is_owner() and torch.equal(rref.local_value(), torch.ones(2))


def test_worker_infos_list_the_static_group() -> None:
    assert get_worker_info("w2") == WorkerInfo("w2", 2)
    assert [i.name for i in get_current_agent().get_worker_infos()] == ["w0", "w1", "w2"]
    assert rpc_sync(1, whoami) == "w1"
    # torch's RuntimeError and phrase, and still this package's ValueError.
    for exc_type in (RuntimeError, ValueError):
        with pytest.raises(exc_type, match="worker_name='nobody': could not find destination"):
            get_worker_info("nobody")


# Security: the agent must unpickle nothing from a peer that did not prove the secret.
def _agent() -> TensorPipeAgent:
    return get_current_agent()


def _request_frame(payload: bytes) -> bytes:
    return encode_header(Kind.REQUEST, 1, len(payload), 0, 0) + payload


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_armed_payload_would_create_its_file(tmp_path: Path) -> None:
    import pickle

    target = tmp_path / "control"
    pickle.loads(armed_payload(target)).close()
    assert target.exists()


@pytest.mark.parametrize("secret", [None, b"wrong-secret", TOKEN.encode()])
def test_unauthenticated_pickle_is_never_loaded(tmp_path: Path, secret: bytes | None) -> None:
    """No handshake, a wrong secret, or the right secret but no group membership: closed unread."""
    target = tmp_path / "pwned"
    with socket.create_connection(_agent().address, timeout=5) as sock:
        if secret is not None:
            with pytest.raises(AuthenticationError):
                client_handshake(sock, secret, PeerIdentity("intruder", 7), None)
        else:
            sock.sendall(_request_frame(armed_payload(target)) * 4)
        if secret is not None:
            with contextlib.suppress(OSError):
                sock.sendall(_request_frame(armed_payload(target)))
        assert _closed_by_peer(sock)
    time.sleep(0.2)
    assert not target.exists()
    assert rpc_sync("w1", sleep_then, args=(0.0, 1)) == 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200), cut=st.integers(min_value=0, max_value=HEADER.size))
def test_random_and_truncated_bytes_never_stop_the_agent(data: bytes, cut: int) -> None:
    frame = _request_frame(data)[: cut + len(data)]
    with socket.create_connection(_agent().address, timeout=5) as sock:
        try:
            sock.sendall(data + frame)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        assert _closed_by_peer(sock)
    assert rpc_sync("w2", sleep_then, args=(0.0, 2)) == 2
