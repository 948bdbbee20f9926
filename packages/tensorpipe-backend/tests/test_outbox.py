"""A connection's outbox on a socket pair: posting never waits for the peer to read, and every
frame arrives whole and in order, from the main thread and from others."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import tensorpipe_backend.outbox as outbox_module
from tensorpipe_backend.outbox import Outbox

pytestmark = pytest.mark.timeout(30)

FRAMES = [bytes([i]) * 50_000 + b"|" for i in range(40)]  # 2 MB: far more than the socket holds


@pytest.fixture
def ends() -> Iterator[tuple[Outbox, threading.Lock, socket.socket]]:
    """An outbox on one end of a socket pair, its send lock, and the peer's end."""
    mine, theirs = socket.socketpair()
    lock = threading.Lock()
    outbox = Outbox(mine, lock, "p", _start_daemon)
    yield outbox, lock, theirs
    outbox.close()
    mine.close()
    theirs.close()


def _start_daemon(target: Callable[[], None], name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()


def _in_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on another thread; it must return while nobody reads the socket."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "a post waited for the peer to read"


def _read(sock: socket.socket, size: int) -> bytes:
    sock.settimeout(10)
    parts, got = [], 0
    while got < size:
        part = sock.recv(size - got)
        assert part, "the connection closed early"
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def test_posts_on_a_full_socket_return_at_once_and_go_out_whole_and_in_order(
    ends: tuple[Outbox, threading.Lock, socket.socket],
) -> None:
    outbox, _, theirs = ends

    def post_all() -> None:
        for frame in FRAMES:
            outbox.post(frame)

    _in_thread(post_all)
    assert outbox, "the socket took everything: the test did not fill it"
    assert _read(theirs, sum(map(len, FRAMES))) == b"".join(FRAMES)
    deadline = time.monotonic() + 5  # the writer takes sent frames off after their last bytes went
    while outbox and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not outbox


def test_a_reader_that_cannot_take_the_send_lock_still_never_waits(
    ends: tuple[Outbox, threading.Lock, socket.socket],
) -> None:
    outbox, lock, theirs = ends
    with lock:  # another thread sends a frame of its own meanwhile
        _in_thread(lambda: outbox.post(FRAMES[0]))
    outbox.flush()  # what the holder does once it lets go
    assert _read(theirs, len(FRAMES[0])) == FRAMES[0]


def test_the_main_thread_queues_its_frame_behind_a_half_sent_one() -> None:
    # The main thread never sends the rest of another thread's frame (a signal handler raising
    # there could lose count of it): it queues its own behind, for the writer thread, which is
    # held back here until the main thread is done.
    mine, theirs = socket.socketpair()
    lock = threading.Lock()
    writers: list[Callable[[], None]] = []
    outbox = Outbox(mine, lock, "p", lambda target, name: writers.append(target))
    big = FRAMES[0] * 10
    try:
        _in_thread(lambda: outbox.post(big))
        assert outbox, "the socket took everything: the test did not fill it"
        with lock:
            outbox.send(FRAMES[1])
        _start_daemon(writers[0], "write-p")
        assert _read(theirs, len(big) + len(FRAMES[1])) == big + FRAMES[1]
    finally:
        outbox.close()
        mine.close()
        theirs.close()


def test_another_thread_sends_the_queue_before_its_own_frame(
    ends: tuple[Outbox, threading.Lock, socket.socket],
) -> None:
    outbox, lock, theirs = ends
    _in_thread(lambda: outbox.post(FRAMES[0] * 10))

    def send_own() -> None:
        with lock:
            assert outbox.cleared()
            outbox.send(FRAMES[2])

    sender = threading.Thread(target=send_own, daemon=True)
    sender.start()
    big = FRAMES[0] * 10
    assert _read(theirs, len(big) + len(FRAMES[2])) == big + FRAMES[2]
    sender.join(timeout=10)
    assert not sender.is_alive()


def test_a_frame_posted_while_the_writer_finishes_sending_goes_out_without_waiting_a_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A post while the writer thread holds the send lock leaves the frame to it (flush cannot take
    # the lock); the writer must look at the queue again once it lets go, not sleep until its tick.
    monkeypatch.setattr(outbox_module, "_TICK", 60.0)
    mine, theirs = socket.socketpair()
    writers: list[Callable[[], None]] = []
    outbox = Outbox(mine, threading.Lock(), "p", lambda target, name: writers.append(target))
    send, late = outbox._send, b"late|"
    posted: list[bool] = []

    def send_then_post(wait: bool) -> bool:
        done = send(wait)
        if threading.current_thread().name == "write-p" and not posted:
            posted.append(True)
            _in_thread(lambda: outbox.post(late))
        return done

    monkeypatch.setattr(outbox, "_send", send_then_post)
    big = FRAMES[0] * 10
    try:
        _in_thread(lambda: outbox.post(big))
        assert outbox, "the socket took everything: the test did not fill it"
        threading.Thread(target=writers[0], name="write-p", daemon=True).start()
        assert _read(theirs, len(big) + len(late)) == big + late
        assert posted
    finally:
        outbox.close()
        mine.close()
        theirs.close()


def test_a_closed_outbox_ends_its_writer_and_refuses_the_main_threads_wait(
    ends: tuple[Outbox, threading.Lock, socket.socket],
) -> None:
    outbox, _, _ = ends
    writers = [t for t in threading.enumerate() if t.name == "write-p"]
    outbox.close()
    for writer in writers:
        writer.join(timeout=5)
    assert writers and not any(writer.is_alive() for writer in writers)
    with pytest.raises(ConnectionError, match="to p is closed"):
        outbox.wait_for_writer()
