"""The handshake on its own, over a socket pair: what each end learns, and when."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tensorpipe_backend import auth
from tensorpipe_backend.auth import (
    AuthenticationError,
    HandshakeCut,
    HandshakeStatus,
    PeerIdentity,
    client_handshake,
    server_handshake,
)

pytestmark = pytest.mark.timeout(30)

SECRET = b"the job's secret"


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected (server, client) pair, closed after the test."""
    server, client = socket.socketpair()
    for sock in (server, client):
        sock.settimeout(10)
    with server, client:
        yield server, client


def test_a_client_tells_its_name_and_rank_to_no_server_that_has_not_proved_the_secret(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    me = PeerIdentity("trainer-with-a-telling-name", 4242)
    outcome: list[BaseException] = []

    def dial() -> None:
        try:
            client_handshake(client, SECRET, me, None)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            outcome.append(error)

    thread = threading.Thread(target=dial)
    thread.start()
    # An impostor: it speaks the protocol but does not hold the secret.
    server.sendall(auth._HELLO.pack(auth._MAGIC, auth._VERSION, os.urandom(auth._NONCE)))
    received = b""
    server.settimeout(1)
    try:
        while chunk := server.recv(4096):
            received += chunk
    except TimeoutError:
        pass  # the client waits for a verdict: it has sent all it will
    server.close()
    thread.join(10)
    assert len(received) == auth._PROOF.size + auth._MAC  # fixed: the name's length is not told either
    assert me.name.encode() not in received
    assert struct.pack("!q", me.rank) not in received
    assert len(outcome) == 1 and isinstance(outcome[0], AuthenticationError)


@pytest.mark.parametrize("name", ["w1", "é" * 127, "x" * 255])
def test_the_server_learns_the_client_it_authenticated(
    name: str, pair: tuple[socket.socket, socket.socket]
) -> None:
    server, client = pair
    seen: dict[str, Any] = {}

    def serve() -> None:
        peer, _ = server_handshake(
            server, SECRET, PeerIdentity("server", 0), lambda p: HandshakeStatus.ACCEPTED
        )
        seen["peer"] = peer

    thread = threading.Thread(target=serve)
    thread.start()
    reached, status = client_handshake(client, SECRET, PeerIdentity(name, 7), PeerIdentity("server", 0))
    thread.join(10)
    assert seen["peer"] == PeerIdentity(name, 7)
    assert (reached, status) == (PeerIdentity("server", 0), HandshakeStatus.ACCEPTED)


def test_a_server_that_holds_another_secret_learns_nothing_and_refuses(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server_handshake(
                server, b"another secret", PeerIdentity("server", 0), lambda p: HandshakeStatus.ACCEPTED
            )
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors.append(error)
        finally:
            server.close()

    thread = threading.Thread(target=serve)
    thread.start()
    with pytest.raises(AuthenticationError, match="holds a different secret"):
        client_handshake(client, SECRET, PeerIdentity("w1", 1), None)
    thread.join(10)
    assert len(errors) == 1 and str(errors[0]) == "a client failed the secret check"


@pytest.mark.parametrize(
    ("when", "fresh"), [("after the proof", True), ("before the proof", False), ("too late", False)]
)
def test_a_cut_handshake_tells_the_client_to_dial_again_not_that_secrets_differ(
    when: str, fresh: bool, pair: tuple[socket.socket, socket.socket]
) -> None:
    """A server that cut a handshake (for a flood of others, or too slow) says busy, whether
    ``decide`` found it cut after the proof, the cut ended its read first, or its read timed out:
    the client may dial again. Only the first answer is bound to the client's nonce."""
    server, client = pair
    me = PeerIdentity("server", 0)

    def serve() -> None:
        with contextlib.suppress(EOFError, TimeoutError):
            if when == "after the proof":
                server_handshake(server, SECRET, me, lambda p: HandshakeStatus.BUSY)
            elif when == "before the proof":
                server.shutdown(socket.SHUT_RD)  # as the accept loop's cut does
                server_handshake(server, SECRET, me, lambda p: HandshakeStatus.ACCEPTED, lambda: True)
            else:
                server.settimeout(0.2)
                server_handshake(server, SECRET, me, lambda p: HandshakeStatus.ACCEPTED)

    thread = threading.Thread(target=serve)
    thread.start()
    if when == "too late":
        thread.join(10)  # the client's proof comes after the server's timeout
    with pytest.raises(HandshakeCut, match="cut the handshake") as caught:
        client_handshake(client, SECRET, PeerIdentity("w1", 1), me)
    thread.join(10)
    assert caught.value.fresh is fresh


class _CutOnceTheProofIsIn:
    """A server's socket cut (``SHUT_RD``, as the accept loop does) once the client's whole proof
    is waiting in it, unread."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)  # the hello
        proof = auth._PROOF.size + auth._MAC
        while len(self._sock.recv(proof, socket.MSG_PEEK)) < proof:
            time.sleep(0.01)
        self._sock.shutdown(socket.SHUT_RD)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_a_wrong_secret_is_told_as_such_even_from_a_cut_handshake(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """The cut came after the proof arrived: the server still judges it, and a wrong one is a
    wrong secret, not a reason to dial again."""
    server, client = pair

    def serve() -> None:
        with contextlib.suppress(AuthenticationError):
            server_handshake(
                _CutOnceTheProofIsIn(server),  # type: ignore[arg-type]
                b"another secret",
                PeerIdentity("server", 0),
                lambda p: HandshakeStatus.ACCEPTED,
                lambda: True,
            )
        server.close()

    thread = threading.Thread(target=serve)
    thread.start()
    with pytest.raises(AuthenticationError, match="holds a different secret"):
        client_handshake(client, SECRET, PeerIdentity("w1", 1), None)
    thread.join(10)


@pytest.mark.parametrize("made", ["with another secret", "for another client"])
def test_a_busy_answer_not_made_for_this_handshake_is_not_believed(
    made: str, pair: tuple[socket.socket, socket.socket]
) -> None:
    """A stranger (a process on a lost worker's old port) cannot make a member dial it again and
    again: a busy answer made without the secret, or recorded after another client's proof, fails
    the secret check. (One recorded before any proof is taken, marked not fresh: a dialler takes a
    few of those in a row at most.)"""
    server, client = pair
    nonce = os.urandom(auth._NONCE)
    server.sendall(auth._HELLO.pack(auth._MAGIC, auth._VERSION, nonce))
    if made == "with another secret":
        server.sendall(auth._busy(b"another secret", nonce, None))
    else:
        server.sendall(auth._busy(SECRET, nonce, os.urandom(auth._NONCE)))
    with pytest.raises(AuthenticationError, match="failed the secret check"):
        client_handshake(client, SECRET, PeerIdentity("w1", 1), None)
