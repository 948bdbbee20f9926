"""The HMAC challenge both ends of a connection pass before any frame is read.

Both sides send a fresh random nonce; each proves it holds the job's secret
(see :mod:`tensorpipe_backend.secret`) with an HMAC over both nonces and its
identity, so a recorded exchange cannot be replayed. The messages are
structs (no pickle). Neither end tells who it is to one that has not proved
the secret: the server, which anyone who can reach its port or its Unix
socket may talk to, gives its name and rank only with its verdict; the
client, which may have dialed an impostor, sends its own sealed: XORed with
a keystream only holders of the secret can derive (HMAC-SHA256 of both
nonces and a counter), padded to a fixed size, and covered by the proof's MAC.

Handshake, server ``S`` and dialing client ``C``::

    S -> C  hello:   magic, version, nonce_s
    C -> S  proof:   magic, nonce_c, sealed = seal(rank_c, name_c), HMAC(secret, "client" nonce_s nonce_c sealed)
    S -> C  verdict: status, rank_s, name_s, HMAC(secret, "server" nonce_c nonce_s status rank_s name_s)

``S`` reads a fixed-size proof, checks its MAC, then unseals; it closes
without a verdict when the proof is wrong. ``C`` checks the verdict's HMAC
and that ``S`` is the worker it meant to reach.

A server that cuts a handshake (too many at once from one source, or too
slow) says busy instead of a verdict::

    S -> C  busy:    status BUSY, rank 0, no name, HMAC(secret, "busy:proof" nonce_s nonce_c)
                     or, cut before the proof arrived, HMAC(secret, "busy:hello" nonce_s)

``C`` checks its HMAC and dials again (:class:`HandshakeCut`). The first
form is bound to ``C``'s nonce; the second can be replayed by one who
recorded it (for a nonce of the server's own choosing), so a dialler takes
only a few of those in a row. A clean close after the proof still means the
two hold different secrets.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from .secret import AUTH_TOKEN_ENV
from .wire import recv_exact

__all__ = [
    "HELLO_BYTES",
    "AuthenticationError",
    "HandshakeCut",
    "HandshakeStatus",
    "PeerIdentity",
    "client_handshake",
    "server_handshake",
]

_MAGIC: Final = b"TPBA"
_VERSION: Final = 4
_NONCE: Final = 32
_MAX_NAME: Final = 255
_HELLO: Final = struct.Struct(f"!4sB{_NONCE}s")
_IDENTITY: Final = struct.Struct(f"!qB{_MAX_NAME}s")  # rank, name length, name padded with zeros
_PROOF: Final = struct.Struct(f"!4s{_NONCE}s{_IDENTITY.size}s")
_VERDICT: Final = struct.Struct("!BqB")
_MAC: Final = hashlib.sha256().digest_size

HELLO_BYTES: Final = _HELLO.size
"""Everything the server sends before the client's proof: magic, version and its nonce."""


class AuthenticationError(ConnectionError):
    """The other end of a connection did not prove it holds the job's secret."""


class HandshakeCut(ConnectionError):
    """The server cut this handshake to make room for others (a flood of connections, or ours
    was too slow): not a verdict on this client; dial again.

    Attributes:
        fresh: whether the answer is bound to this handshake (it came after our proof); one that
            is not could be a recorded one, replayed.
    """

    def __init__(self, message: str, fresh: bool) -> None:
        super().__init__(message)
        self.fresh = fresh


class HandshakeStatus(enum.IntEnum):
    """The server's verdict on an authenticated client."""

    ACCEPTED = 0
    DUPLICATE = 1
    """Authenticated, but another connection between the two is kept: use that one."""
    REFUSED = 2
    """Authenticated, but this worker judged the client lost: it does not talk to it again."""
    BUSY = 3
    """The handshake was cut (too many at once, or too slow) before a verdict: dial again."""


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


def _keystream(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    blocks = -(-_IDENTITY.size // _MAC)
    return b"".join(
        hmac.new(secret, b"seal" + nonce_s + nonce_c + bytes([i]), hashlib.sha256).digest()
        for i in range(blocks)
    )[: _IDENTITY.size]


def _xor(data: bytes, key: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(len(data), "big")


def _seal(me: PeerIdentity, secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    name = _encode_name(me.name)
    return _xor(_IDENTITY.pack(me.rank, len(name), name), _keystream(secret, nonce_s, nonce_c))


def _unseal(sealed: bytes, secret: bytes, nonce_s: bytes, nonce_c: bytes) -> PeerIdentity:
    rank, length, padded = _IDENTITY.unpack(_xor(sealed, _keystream(secret, nonce_s, nonce_c)))
    if not 0 < length <= _MAX_NAME:
        raise AuthenticationError(f"the peer sent a worker name of {length} bytes")
    try:
        return PeerIdentity(padded[:length].decode(), rank)
    except UnicodeDecodeError:
        raise AuthenticationError("the peer sent a worker name that is not UTF-8") from None


def _read_name(sock: socket.socket, length: int) -> str:
    if length == 0:
        raise AuthenticationError("the peer sent an empty worker name")
    try:
        return recv_exact(sock, length).decode()
    except UnicodeDecodeError:
        raise AuthenticationError("the peer sent a worker name that is not UTF-8") from None


def _busy(secret: bytes, nonce_s: bytes, nonce_c: bytes | None) -> bytes:
    """The busy answer: bound to the client's nonce once its proof arrived."""
    said = b"busy:hello" + nonce_s if nonce_c is None else b"busy:proof" + nonce_s + nonce_c
    return _VERDICT.pack(HandshakeStatus.BUSY, 0, 0) + hmac.new(secret, said, hashlib.sha256).digest()


def server_handshake(
    sock: socket.socket,
    secret: bytes,
    me: PeerIdentity,
    decide: Callable[[PeerIdentity], HandshakeStatus],
    was_cut: Callable[[], bool] = lambda: False,
) -> tuple[PeerIdentity, HandshakeStatus]:
    """Authenticate the client on ``sock`` (the caller sets a socket timeout).

    ``decide`` is called only for an authenticated client, and only then
    does ``me`` leave this worker; when it says ``BUSY``, the client is told
    busy. So is a client whose proof did not arrive in the socket's timeout,
    or before the caller cut the handshake (ending the read; ``was_cut``
    says so). Raises :class:`AuthenticationError` (the caller closes
    ``sock``) on a wrong proof, or ``EOFError``/``OSError`` on a broken
    connection.
    """
    nonce_s = secrets.token_bytes(_NONCE)
    name_s = _encode_name(me.name)
    sock.sendall(_HELLO.pack(_MAGIC, _VERSION, nonce_s))
    try:
        magic, nonce_c, sealed = _PROOF.unpack(recv_exact(sock, _PROOF.size))
        if magic != _MAGIC:
            raise AuthenticationError(f"bad magic {bytes(magic)!r}: the client does not speak this protocol")
        mac = bytes(recv_exact(sock, _MAC))
    except (EOFError, TimeoutError) as exc:
        if isinstance(exc, TimeoutError) or was_cut():
            with contextlib.suppress(OSError):
                sock.sendall(_busy(secret, nonce_s, None))
        raise
    expected = hmac.new(secret, b"client" + nonce_s + nonce_c + sealed, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise AuthenticationError("a client failed the secret check")
    peer = _unseal(sealed, secret, nonce_s, nonce_c)
    status = decide(peer)
    if status is HandshakeStatus.BUSY:
        sock.sendall(_busy(secret, nonce_s, nonce_c))
        return peer, status
    verdict = hmac.new(
        secret,
        b"server" + nonce_c + nonce_s + bytes([status]) + _identity_bytes(me.rank, me.name),
        hashlib.sha256,
    ).digest()
    sock.sendall(_VERDICT.pack(int(status), me.rank, len(name_s)) + name_s + verdict)
    return peer, status


def client_handshake(
    sock: socket.socket, secret: bytes, me: PeerIdentity, expected: PeerIdentity | None
) -> tuple[PeerIdentity, HandshakeStatus]:
    """Authenticate to the server on ``sock`` and check that it is ``expected`` (if given).

    Raises :class:`AuthenticationError` when the server does not prove the
    secret, is someone else, or closes the connection (its check of our
    proof failed: the two workers hold different secrets), and
    :class:`HandshakeCut` when the server cut the handshake (dial again).
    """
    magic, version, nonce_s = _HELLO.unpack(recv_exact(sock, _HELLO.size))
    if magic != _MAGIC or version != _VERSION:
        raise AuthenticationError(
            f"the server does not speak this protocol (magic {bytes(magic)!r}, version {version}, "
            f"expected {_VERSION}); run the same tensorpipe-backend version on every worker"
        )
    nonce_c = secrets.token_bytes(_NONCE)
    sealed = _seal(me, secret, nonce_s, nonce_c)
    mac = hmac.new(secret, b"client" + nonce_s + nonce_c + sealed, hashlib.sha256)
    unsent: OSError | None = None
    try:
        sock.sendall(_PROOF.pack(_MAGIC, nonce_c, sealed) + mac.digest())
    except (BrokenPipeError, ConnectionResetError) as exc:
        unsent = exc  # the server may have said busy and closed: what it said is read below
    reached = f"worker {expected.name}" if expected is not None else "the server"
    try:
        status_byte, rank_s, name_len = _VERDICT.unpack(recv_exact(sock, _VERDICT.size))
        if status_byte == HandshakeStatus.BUSY:
            said = _VERDICT.pack(status_byte, rank_s, name_len) + bytes(recv_exact(sock, _MAC))
            for fresh, nonce in ((True, nonce_c), (False, None)):
                if hmac.compare_digest(said, _busy(secret, nonce_s, nonce)):
                    raise HandshakeCut(
                        f"{reached} cut the handshake to make room for other connections", fresh
                    )
            raise AuthenticationError(f"{reached} failed the secret check")
        name_s = _read_name(sock, name_len)
        verdict = bytes(recv_exact(sock, _MAC))
    except EOFError:
        if unsent is not None:
            raise unsent from None  # closed before our proof arrived: it never judged it
        raise AuthenticationError(
            f"{reached} closed the connection during authentication: it holds a different "
            f"secret; give every worker the same auth_token or {AUTH_TOKEN_ENV}"
        ) from None
    expected_verdict = hmac.new(
        secret,
        b"server" + nonce_c + nonce_s + bytes([status_byte]) + _identity_bytes(rank_s, name_s),
        hashlib.sha256,
    ).digest()
    if not hmac.compare_digest(verdict, expected_verdict):
        raise AuthenticationError(f"{reached} failed the secret check")
    server = PeerIdentity(name_s, rank_s)
    if expected is not None and server != expected:
        raise AuthenticationError(f"expected worker {expected.name} (rank {expected.rank}), reached {server}")
    try:
        status = HandshakeStatus(status_byte)
    except ValueError:
        raise AuthenticationError(f"worker {name_s} answered with unknown status {status_byte}") from None
    return server, status
