"""Replies that carry up to 16 MiB inline (payload and tensors) leave without the answering
thread waiting for the peer to read: a reader that waited would stop reading, and a peer whose
reader waits likewise would never drain its socket either. A larger reply's thread leaves the
reading to another before it waits."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch.futures import Future

from rpc_registry import Message
from tensorpipe_backend.calls import Calls
from tensorpipe_backend.connection import Connection, prepare_tensor
from tensorpipe_backend.lane import LANE_MIN_BYTES
from tensorpipe_backend.outbox import Outbox
from tensorpipe_backend.requests import Requests
from tensorpipe_backend.watch import Watch
from tensorpipe_backend.wire import HEADER, Kind, encode_descriptors, encode_header, tensor_bytes

pytestmark = pytest.mark.timeout(30)

REPLIES = [bytes([i]) * 200_000 for i in range(8)]  # 1.6 MB: far more than the socket holds
TENSOR_BYTES = 200_000


def _start_daemon(target: Callable[[], None], name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()


class _Connection:
    """What a reply uses of a connection: its outbox, and ``write``, which sends a frame
    itself, waiting for the peer to read, as the real one does."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.outbox = Outbox(sock, self.send_lock, "p", _start_daemon)
        self.closed = False
        self.peer = SimpleNamespace(name="p")
        self.reader: object = None
        self.stream = SimpleNamespace(has_frame=lambda: False)
        self.shm = None  # another host's peer: tensors go inline

    def frame_to_post(self, *args: Any) -> bytes | None:
        return Connection.frame_to_post(cast(Any, self), *args)

    def write(self, kind: Kind, msg_id: int, payload: bytes, prepared: list[Any]) -> None:
        descriptors = encode_descriptors([desc for desc, _ in prepared])
        header = encode_header(kind, msg_id, len(payload), len(prepared), len(descriptors))
        while True:  # as the real one: what was posted goes first
            with self.send_lock:
                if self.outbox.cleared():
                    self.sock.sendall(
                        b"".join([header, descriptors, payload, *(tensor_bytes(t) for _, t in prepared)])
                    )
                    return
            self.outbox.wait_for_writer()


@contextlib.contextmanager
def _answering(
    replies: list[bytes], with_tensor: bool, leave_reading: Callable[[], None] = lambda: None
) -> Iterator[tuple[Requests, _Connection, socket.socket]]:
    """Requests that answer each with the next of ``replies`` (and, ``with_tensor``, a tensor
    of TENSOR_BYTES holding its first byte), on one end of a socket pair; the peer's end.
    ``leave_reading`` is what the answering thread calls before it may wait for the peer."""
    mine, theirs = socket.socketpair()
    conn = _Connection(mine)
    lock = threading.RLock()
    calls = Calls("me", lock, threading.Condition(lock))
    pool = ThreadPoolExecutor(2)
    requests = Requests("me", lock, calls, pool, lambda name: {}, Watch(), leave_reading)
    answers = iter(replies)

    def handler(peer: Any, message: Message) -> Future[Message]:
        reply: Future[Message] = Future()
        payload = next(answers)
        tensors = (torch.full((TENSOR_BYTES,), payload[0], dtype=torch.uint8),) if with_tensor else ()
        reply.set_result(Message(payload, tensors))
        return reply

    requests.start(handler)
    try:
        yield requests, conn, theirs
    finally:
        conn.outbox.close()
        pool.shutdown()
        mine.close()
        theirs.close()


@pytest.fixture(params=[False, True], ids=["payload", "payload-and-tensor"])
def answering(request: pytest.FixtureRequest) -> Iterator[tuple[Requests, _Connection, socket.socket]]:
    """:func:`_answering` REPLIES, with and without a tensor each."""
    with _answering(REPLIES, request.param) as ends:
        yield ends


def _answer_all(requests: Requests, conn: _Connection, count: int) -> threading.Thread:
    """A thread that hands ``requests`` ``count`` requests (answered in it), started."""

    def answer_all() -> None:
        for msg_id in range(count):
            requests.enqueue(cast(Any, conn), msg_id, Message(b"call"))

    thread = threading.Thread(target=answer_all, daemon=True)
    thread.start()
    return thread


def _read_replies(sock: socket.socket, replies: list[bytes]) -> None:
    """Read a reply frame for each of ``replies`` and check it is that one, in order."""
    for msg_id, payload in enumerate(replies):
        _, kind, got_id, payload_len, tensor_count, descriptors_len = HEADER.unpack(_read(sock, HEADER.size))
        assert (kind, got_id, payload_len) == (int(Kind.REPLY), msg_id, len(payload))
        _read(sock, descriptors_len)
        assert _read(sock, len(payload)) == payload
        if tensor_count:
            assert _read(sock, TENSOR_BYTES) == payload[:1] * TENSOR_BYTES


def _read(sock: socket.socket, size: int) -> bytes:
    sock.settimeout(10)
    parts, got = [], 0
    while got < size:
        part = sock.recv(size - got)
        assert part, "the connection closed early"
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def test_replies_of_hundreds_of_kilobytes_never_wait_for_the_peer_and_arrive_whole_in_order(
    answering: tuple[Requests, _Connection, socket.socket],
) -> None:
    requests, conn, theirs = answering
    thread = _answer_all(requests, conn, len(REPLIES))
    thread.join(timeout=10)
    assert not thread.is_alive(), "answering waited for the peer to read"
    _read_replies(theirs, REPLIES)


def test_replies_to_a_peer_that_does_not_read_stop_queueing_at_16_mib_and_all_arrive_in_order() -> None:
    replies = [bytes([i]) * 3_000_000 for i in range(10)]  # 30 MB
    with _answering(replies, with_tensor=False) as (requests, conn, theirs):
        thread = _answer_all(requests, conn, len(replies))
        thread.join(timeout=2)
        assert thread.is_alive(), "30 MB of replies were all queued for a peer that does not read"
        assert conn.outbox.queued_bytes() <= 16 << 20
        _read_replies(theirs, replies)
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_replies_of_megabytes_of_payload_never_wait_for_the_peer_and_arrive_whole_in_order() -> None:
    replies = [bytes([i]) * 6_000_000 for i in range(2)]  # each more than 4 MiB, together under 16 MiB
    with _answering(replies, with_tensor=False) as (requests, conn, theirs):
        thread = _answer_all(requests, conn, len(replies))
        thread.join(timeout=10)
        assert not thread.is_alive(), "answering waited for the peer to read"
        _read_replies(theirs, replies)


def test_a_reply_whose_tensor_a_second_connection_would_carry_is_not_posted() -> None:
    mine, theirs = socket.socketpair()
    with mine, theirs:
        conn = _Connection(mine)
        large = torch.zeros(LANE_MIN_BYTES, dtype=torch.uint8)
        below = torch.zeros(LANE_MIN_BYTES - 1, dtype=torch.uint8)
        for tensor, posted in ((large, False), (below, True)):
            prepared = [prepare_tensor(tensor, {}, "p", is_request=False)]
            frame = conn.frame_to_post(Kind.REPLY, 1, b"reply", prepared)
            assert (frame is not None) == posted, tensor.numel()
        conn.outbox.close()


def test_a_reply_too_large_to_post_lets_another_thread_read_before_it_waits_for_the_peer() -> None:
    # Over 16 MiB, a reply leaves from the answering thread, which waits for the peer to read.
    replies = [b"small", b"l" * (17 << 20), b"after"]
    left: list[int] = []
    with _answering(replies, False, lambda: left.append(conn.outbox.queued_bytes())) as (
        requests,
        conn,
        theirs,
    ):
        thread = _answer_all(requests, conn, len(replies))
        thread.join(timeout=2)
        assert thread.is_alive(), "17 MiB went out to a peer that does not read"
        assert left == [0], "the answering thread waits for the peer without leaving the reading first"
        _read_replies(theirs, replies)
        thread.join(timeout=10)
        assert left == [0], "a posted reply made the answering thread leave the reading"


def test_replies_held_back_from_a_peer_that_does_not_read_keep_the_reading_where_it_is() -> None:
    # A peer that reads nothing would make every reply wait in its own thread: those wait in the
    # answering one (the watch moves reading on), not one new reader each.
    replies = [bytes([i]) * 3_000_000 for i in range(10)]  # 30 MB, over the 16 MiB queued at most
    left: list[int] = []
    with _answering(replies, False, lambda: left.append(1)) as (requests, conn, theirs):
        thread = _answer_all(requests, conn, len(replies))
        thread.join(timeout=2)
        assert thread.is_alive()
        _read_replies(theirs, replies)
        thread.join(timeout=10)
    assert left == []
