"""The job's shared secret and the HMAC challenge both ends of a connection pass.

Both sides send a fresh random nonce; each proves it holds the secret with an
HMAC over both nonces and its identity, so a recorded exchange cannot be
replayed. The messages are fixed-size structs (no pickle): a peer that fails
is disconnected before any frame of it is read.

Handshake, server ``S`` and dialing client ``C``::

    S -> C  hello:   magic, version, nonce_s, rank_s, name_s
    C -> S  proof:   magic, nonce_c, rank_c, name_c, HMAC(secret, "client" nonce_s nonce_c rank_c name_c)
    S -> C  verdict: status, HMAC(secret, "server" nonce_c nonce_s status rank_s name_s)

``S`` closes without a verdict when the proof is wrong.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from .secret import AUTH_TOKEN_ENV
from .wire import recv_exact

logger = logging.getLogger(__name__)

__all__ = [
    "AuthenticationError",
    "HandshakeStatus",
    "PeerIdentity",
    "client_handshake",
    "server_handshake",
]

_MAGIC: Final = b"TPBA"
_VERSION: Final = 1
_NONCE: Final = 32
_MAX_NAME: Final = 255
_HELLO: Final = struct.Struct(f"!4sB{_NONCE}sqB")
_PROOF: Final = struct.Struct(f"!4s{_NONCE}sqB")
_VERDICT: Final = struct.Struct("!B32s")


class AuthenticationError(ConnectionError):
    """The other end of a connection did not prove it holds the job's secret."""


class HandshakeStatus(enum.IntEnum):
    """The server's verdict on an authenticated client."""

    ACCEPTED = 0
    DUPLICATE = 1
    """Authenticated, but another connection between the two is kept: use that one."""


@dataclass(frozen=True)
class PeerIdentity:
    """Who authenticated at the other end."""

    name: str
    rank: int


def _identity_bytes(rank: int, name: str) -> bytes:
    return struct.pack("!q", rank) + name.encode()


def _encode_name(name: str) -> bytes:
    raw = name.encode()
    if not 0 < len(raw) <= _MAX_NAME:
        raise ValueError(f"worker name {name!r}: must be 1 to {_MAX_NAME} bytes")
    return raw


def _read_name(sock: socket.socket, length: int) -> str:
    if length == 0:
        raise AuthenticationError("the peer sent an empty worker name")
    try:
        return recv_exact(sock, length).decode()
    except UnicodeDecodeError:
        raise AuthenticationError("the peer sent a worker name that is not UTF-8") from None


def server_handshake(
    sock: socket.socket,
    secret: bytes,
    me: PeerIdentity,
    decide: Callable[[PeerIdentity], HandshakeStatus],
) -> tuple[PeerIdentity, HandshakeStatus]:
    """Authenticate the client on ``sock`` (the caller sets a socket timeout).

    ``decide`` is called only for an authenticated client. Raises
    :class:`AuthenticationError` (the caller closes ``sock``) on a wrong
    proof, or ``EOFError``/``OSError`` on a broken connection.
    """
    nonce_s = secrets.token_bytes(_NONCE)
    name_s = _encode_name(me.name)
    sock.sendall(_HELLO.pack(_MAGIC, _VERSION, nonce_s, me.rank, len(name_s)) + name_s)
    magic, nonce_c, rank_c, name_len = _PROOF.unpack(recv_exact(sock, _PROOF.size))
    if magic != _MAGIC:
        raise AuthenticationError(f"bad magic {bytes(magic)!r}: the client does not speak this protocol")
    name_c = _read_name(sock, name_len)
    mac = bytes(recv_exact(sock, hashlib.sha256().digest_size))
    expected = hmac.new(
        secret, b"client" + nonce_s + nonce_c + _identity_bytes(rank_c, name_c), hashlib.sha256
    ).digest()
    if not hmac.compare_digest(mac, expected):
        raise AuthenticationError(
            f"a client claiming to be {name_c!r} (rank {rank_c}) failed the secret check"
        )
    peer = PeerIdentity(name_c, rank_c)
    status = decide(peer)
    verdict = hmac.new(
        secret,
        b"server" + nonce_c + nonce_s + bytes([status]) + _identity_bytes(me.rank, me.name),
        hashlib.sha256,
    ).digest()
    sock.sendall(_VERDICT.pack(int(status), verdict))
    return peer, status


def client_handshake(
    sock: socket.socket, secret: bytes, me: PeerIdentity, expected: PeerIdentity | None
) -> tuple[PeerIdentity, HandshakeStatus]:
    """Authenticate to the server on ``sock`` and check that it is ``expected`` (if given).

    Raises :class:`AuthenticationError` when the server does not prove the
    secret, is someone else, or closes the connection (its check of our
    proof failed: the two workers hold different secrets).
    """
    magic, version, nonce_s, rank_s, name_len = _HELLO.unpack(recv_exact(sock, _HELLO.size))
    if magic != _MAGIC or version != _VERSION:
        raise AuthenticationError(f"the server does not speak this protocol (magic {bytes(magic)!r})")
    name_s = _read_name(sock, name_len)
    server = PeerIdentity(name_s, rank_s)
    if expected is not None and server != expected:
        raise AuthenticationError(f"expected worker {expected.name} (rank {expected.rank}), reached {server}")
    nonce_c = secrets.token_bytes(_NONCE)
    name_c = _encode_name(me.name)
    mac = hmac.new(secret, b"client" + nonce_s + nonce_c + _identity_bytes(me.rank, me.name), hashlib.sha256)
    sock.sendall(_PROOF.pack(_MAGIC, nonce_c, me.rank, len(name_c)) + name_c + mac.digest())
    try:
        status_byte, verdict = _VERDICT.unpack(recv_exact(sock, _VERDICT.size))
    except EOFError:
        raise AuthenticationError(
            f"worker {name_s} closed the connection during authentication: it holds a different "
            f"secret; give every worker the same auth_token or {AUTH_TOKEN_ENV}"
        ) from None
    try:
        status = HandshakeStatus(status_byte)
    except ValueError:
        raise AuthenticationError(f"worker {name_s} answered with unknown status {status_byte}") from None
    expected_verdict = hmac.new(
        secret,
        b"server" + nonce_c + nonce_s + bytes([status_byte]) + _identity_bytes(rank_s, name_s),
        hashlib.sha256,
    ).digest()
    if not hmac.compare_digest(verdict, expected_verdict):
        raise AuthenticationError(f"worker {name_s} failed the secret check")
    return server, status
