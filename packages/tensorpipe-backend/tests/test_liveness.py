"""The pieces of loss detection in one process: the keepalive thread's verdicts, and taking a lost
worker out of a dynamic group's member list in the store."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator

import pytest
from torch._C._distributed_c10d import HashStore

import tensorpipe_backend.agent as agent_module
from join_core import spare_connections
from rpc_registry import WorkerInfo
from tensorpipe_backend import TensorPipeRpcBackendOptions, init_backend_handler
from tensorpipe_backend.connection import Connection
from tensorpipe_backend.group import (
    MEMBERS_KEY,
    WorkerRecord,
    members,
    membership_token,
    record_key,
    remove_lost_member,
)
from tensorpipe_backend.liveness import Liveness
from tensorpipe_backend.wire import HEADER, Kind

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair() -> Iterator[tuple[Connection, socket.socket]]:
    """A connection to peer "p" (rank 1), and the peer's end of its socket."""
    mine, theirs = socket.socketpair()
    conn = Connection(WorkerInfo("p", 1), mine)
    yield conn, theirs
    conn.outbox.close()
    mine.close()
    theirs.close()


def _liveness(conn: Connection, silent: list[tuple[str, float]]) -> Liveness:
    return Liveness("me", 2.0, lambda: [conn], lambda c, waited: silent.append((c.peer.name, waited)))


def test_a_peer_that_sends_nothing_for_the_timeout_is_reported_silent(
    pair: tuple[Connection, socket.socket],
) -> None:
    conn, _ = pair
    silent: list[tuple[str, float]] = []
    liveness = _liveness(conn, silent)
    for now in (100.0, 100.4, 101.9):
        liveness.tick(now)
    assert silent == []
    liveness.tick(102.0)
    assert silent == [("p", 2.0)]


def test_bytes_from_the_peer_even_inside_a_frame_keep_it_alive(
    pair: tuple[Connection, socket.socket],
) -> None:
    conn, theirs = pair
    silent: list[tuple[str, float]] = []
    liveness = _liveness(conn, silent)
    liveness.tick(100.0)
    theirs.sendall(b"x" * 10)  # the start of a long frame, read as it arrives
    conn.stream.read_into(memoryview(bytearray(10)))
    liveness.tick(101.5)
    liveness.tick(103.0)  # 3 s since the first tick, 1.5 s since the bytes were seen
    assert silent == []
    liveness.tick(103.5)
    assert silent == [("p", 2.0)]


def test_every_tick_sends_the_peer_a_keepalive_that_answers_no_ping(
    pair: tuple[Connection, socket.socket],
) -> None:
    conn, theirs = pair
    _liveness(conn, []).tick(100.0)
    frame = theirs.recv(1024)
    _, kind, msg_id, payload_len, tensor_count, _ = HEADER.unpack(frame)
    assert (kind, msg_id, payload_len, tensor_count, len(frame)) == (Kind.PONG, 0, 0, 0, HEADER.size)


def test_no_keepalive_while_another_frame_is_being_sent(pair: tuple[Connection, socket.socket]) -> None:
    conn, theirs = pair
    theirs.setblocking(False)
    with conn.send_lock:
        _liveness(conn, []).tick(100.0)
    with pytest.raises(BlockingIOError):
        theirs.recv(1024)


def _record(name: str, rank: int, port: int) -> WorkerRecord:
    return WorkerRecord(name, rank, "127.0.0.1", port, 0, {}, [])


def _group(*records: WorkerRecord) -> HashStore:
    store = HashStore()
    for record in records:
        store.set(record_key(record.name), record.to_json())
    store.set(MEMBERS_KEY, json.dumps([r.name for r in records]))
    return store


def test_a_lost_member_leaves_the_member_list_and_frees_its_name() -> None:
    d0, d1, d2 = _record("d0", 0, 1000), _record("d1", 1, 1001), _record("d2", 2, 1002)
    store = _group(d0, d1, d2)
    assert remove_lost_member(store, "d0", d2, 5.0, lambda holder: False)
    assert members(store) == ["d0", "d1"] and not store.check([record_key("d2")])
    assert not remove_lost_member(store, "d1", d2, 5.0, lambda holder: False)  # a second survivor: done


def test_a_name_taken_again_by_a_new_worker_is_not_removed() -> None:
    d0, old, new = _record("d0", 0, 1000), _record("d2", 2, 1002), _record("d2", 3, 2002)
    store = _group(d0, new)
    assert not remove_lost_member(store, "d0", old, 5.0, lambda holder: False)
    assert members(store) == ["d0", "d2"] and WorkerRecord.from_json(store.get(record_key("d2"))) == new


def test_a_worker_no_longer_listed_removes_nobody() -> None:
    d0, d2 = _record("d0", 0, 1000), _record("d2", 2, 1002)
    store = _group(d0, d2)
    with pytest.raises(RuntimeError, match=r"d1 is no longer a member of the group .* it does not remove d2"):
        remove_lost_member(store, "d1", d2, 5.0, lambda holder: False)
    assert members(store) == ["d0", "d2"]


def test_the_membership_token_of_a_lost_worker_is_taken_over() -> None:
    d0, d2 = _record("d0", 0, 1000), _record("d2", 2, 1002)
    store = _group(d0, d2)
    store.compare_set("tensorpipe_backend/token", "", "d2")  # d2 died while joining or leaving
    with pytest.raises(TimeoutError, match=r"held by 'd2'"), membership_token(store, "d0", 0.2):
        pass
    assert remove_lost_member(store, "d0", d2, 5.0, lambda holder: holder == "d2")
    assert members(store) == ["d0"]
    with membership_token(store, "d0", 0.2):  # given back
        pass


def _held_by_d2_at(port: int) -> HashStore:
    """A group whose membership token d2 took, telling it listens on 127.0.0.1:``port``."""
    store = _group(_record("d0", 0, 1000), _record("d2", 2, 1002))
    with membership_token(store, "d2", 0.2, address=("127.0.0.1", port)):
        held = store.get("tensorpipe_backend/token").decode()
    store.compare_set("tensorpipe_backend/token", "", held)  # d2 died while joining or leaving
    return store


def test_the_membership_token_of_a_worker_whose_address_nobody_listens_on_is_taken_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]  # closed below: nobody listens there any more
    store = _held_by_d2_at(port)
    with membership_token(store, "d0", 10.0, address=("127.0.0.1", 1000)):
        assert json.loads(store.get("tensorpipe_backend/token"))["holder"] == "d0"
    assert (
        f"takes over the membership token of 'd2', which no longer listens at 127.0.0.1:{port}" in caplog.text
    )
    with membership_token(store, "d0", 0.2):  # given back
        pass


def test_the_membership_token_of_a_worker_that_still_listens_is_waited_for() -> None:
    with socket.socket() as alive:
        alive.bind(("127.0.0.1", 0))
        alive.listen()
        store = _held_by_d2_at(alive.getsockname()[1])
        with pytest.raises(TimeoutError, match=r"held by 'd2'"), membership_token(store, "d0", 2.5):
            pass


def test_a_shut_down_agent_no_longer_spares_its_listeners_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Join's watch spares the agent's connections after a loss; once the agent is gone the port
    may go to a process group's connection, which the watch must be free to shut down."""
    spared: list[int] = []
    released: list[int] = []

    def recording_spare(port: int) -> Callable[[], None]:
        release = spare_connections(port)
        spared.append(port)

        def recorded_release() -> None:
            released.append(port)
            release()

        return recorded_release

    monkeypatch.setattr(agent_module, "spare_connections", recording_spare)
    options = TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:0", auth_token="t")
    agent = init_backend_handler(HashStore(), "solo", 0, 1, options)
    assert spared == [agent.address[1]] and released == []
    agent.shutdown()
    assert released == spared
