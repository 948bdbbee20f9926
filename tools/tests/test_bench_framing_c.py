"""bench/framing_c: the compiled framing the experiment measures frames exactly as the Python
framing does (else its figures would compare something else), and a missing compiler is named."""

from __future__ import annotations

import importlib
import shutil
import socket
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import bench_framing_c
import pytest

from tensorpipe_backend.wire import HEADER, FrameReader, Kind, small_frame

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def framing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) to build bench/framing_c with")
    folder = tmp_path_factory.mktemp("framing-c")
    failure = bench_framing_c.build(folder)
    assert failure is None, failure
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module(bench_framing_c.MODULE)
    finally:
        sys.path.remove(str(folder))


def test_a_frame_sent_by_c_is_the_python_frame(framing: ModuleType) -> None:
    left, right = socket.socketpair()
    with left, right:
        for kind, msg_id, payload in ((Kind.REQUEST, 7, b"x" * 300), (Kind.REPLY, (1 << 64) - 1, b"")):
            framing.send_small(left.fileno(), int(kind), msg_id, payload)
            expected = small_frame(kind, msg_id, payload)
            assert right.recv(len(expected) + 10) == expected


def test_take_reply_takes_only_the_whole_reply_it_waits_for(framing: ModuleType) -> None:
    left, right = socket.socketpair()
    with left, right:
        buffer = bytearray(HEADER.size + 1024)
        right.setblocking(False)
        assert framing.take_reply(right.fileno(), 5, buffer) is True  # nothing yet
        frame = small_frame(Kind.REPLY, 5, b"answer")
        left.sendall(frame[:10])
        assert framing.take_reply(right.fileno(), 5, buffer) is True  # not whole yet
        left.sendall(frame[10:])
        assert framing.take_reply(right.fileno(), 6, buffer) is False  # another call's reply
        assert framing.take_reply(right.fileno(), 5, buffer) == (int(Kind.REPLY), b"answer")
        left.sendall(small_frame(Kind.REQUEST, 5, b"a request"))
        assert framing.take_reply(right.fileno(), 5, buffer) is False  # the reader thread's
        left.close()
        right.recv(100)
        with pytest.raises(EOFError):
            framing.take_reply(right.fileno(), 5, buffer)


def test_next_small_decodes_what_the_python_reader_does(framing: ModuleType) -> None:
    left, right = socket.socketpair()
    with left, right:
        frames = [small_frame(Kind.REQUEST, 1, b"first"), small_frame(Kind.ERROR, 2, b"second")]
        left.sendall(b"".join(frames))
        reader = FrameReader(right)
        header, _, payload = reader.read_frame()  # fills the buffer with both frames
        assert (header.kind, header.msg_id, payload) == (Kind.REQUEST, 1, b"first")
        decoded = framing.next_small(reader._buffer, reader._start, reader._end)
        assert decoded == (int(Kind.ERROR), 2, b"second", reader._end)
        assert framing.next_small(reader._buffer, reader._end, reader._end) is None  # nothing left
        garbage = bytearray(b"XXXX" + bytes(24))
        assert framing.next_small(garbage, 0, len(garbage)) is None  # the Python reader rejects it


def test_a_missing_compiler_is_named_in_the_figures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda name: "no-such-cc" if name == "CC" else real(name)
    )
    failure = bench_framing_c.build(tmp_path)
    assert failure is not None and failure.startswith("no C extension: no-such-cc failed"), failure
    monkeypatch.setattr(bench_framing_c, "build", lambda folder: failure)
    figures = bench_framing_c.framing_c_figures(1, quick=True)
    assert [f.reference for f in figures] == [failure, failure]
    assert all(f.met and f.goal == "(context)" for f in figures)
