"""Liveness: how a worker learns that a peer is lost, and the keepalive that tells a frozen one.

A peer is *lost* when its process ended, or stopped running, without leaving
the group (``shutdown`` says goodbye first; a lost worker did not). Two
signs tell it, each cheap:

- **Its connection closed and nobody listens at its address.** The kernel
  closes the sockets of a process that ended (killed, crashed) at once. The
  reader sees the connection end and the agent connects to the peer's
  address once (:meth:`tensorpipe_backend.peers.Peers.probe`): refused, the
  peer is lost, within a round trip of its death; greeted, only the
  connection was (the probe hangs up; the next call dials). A later dial of
  a member that is refused is the same sign.
- **It sent nothing for the liveness timeout.** A stopped process
  (``SIGSTOP``, a debugger) keeps its sockets open and its kernel still
  acknowledges TCP keepalives, so only its own silence tells. Every worker
  sends each connected peer a keepalive every fifth of
  ``TensorPipeRpcBackendOptions.liveness_timeout`` (a 24-byte frame that
  never blocks, skipped while another frame is on its way), and counts the
  bytes it reads from each: a peer from which no byte came for the timeout
  is lost. The bytes of a long frame count as they arrive, so a peer
  sending a large tensor is never silent. A dial whose handshake goes
  unanswered for the timeout is the same sign.

Cost: one thread per worker and, per connection and fifth of the timeout,
one small frame each way. A peer is judged lost between one and 1.4 times
the timeout after its last byte. A worker whose own process was held up
past a tick (it could not read either) forgives the silence it saw meanwhile.
What a verdict does is the agent's business (``TensorPipeAgent._judge``):
the peer's calls fail naming it, it leaves the member list of a dynamic
group, it is refused if it comes back, and a static group's shutdown goes on
without it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from .connection import Connection

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["BEATS_PER_TIMEOUT", "Liveness"]

BEATS_PER_TIMEOUT: Final = 5
"""Keepalives (and checks) per liveness timeout."""


class Liveness:
    """The keepalive thread of one agent: keepalives out, and a verdict on every silent peer.

    ``me`` names this worker in logs; ``timeout`` is the liveness timeout in
    seconds (> 0). ``connections`` lists the open connections;
    ``silent(conn, waited)`` hears of a connection whose peer sent nothing
    for ``waited`` (at least ``timeout``) seconds.
    """

    def __init__(
        self,
        me: str,
        timeout: float,
        connections: Callable[[], list[Connection]],
        silent: Callable[[Connection, float], None],
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r}: must be seconds > 0")
        self._me = me
        self.timeout: float = timeout
        self.interval: float = timeout / BEATS_PER_TIMEOUT
        self._connections = connections
        self._silent = silent
        self._stop = threading.Event()
        # Per connection: its byte count when last seen, and since when it has been that.
        self._heard: dict[Connection, tuple[int, float]] = {}

    def close(self) -> None:
        """Stop the thread (it ends within a tick)."""
        self._stop.set()

    def run(self) -> None:
        """The thread: every interval, a tick (see :meth:`tick`), until :meth:`close`."""
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last > 2 * self.interval:
                # This process was held up: its readers could not read either, so the silence
                # seen meanwhile proves nothing.
                logger.debug("%s: liveness tick %.1f s late; silences so far forgiven", self._me, now - last)
                self._heard.clear()
            last = now
            self.tick(now)

    def tick(self, now: float) -> None:
        """Judge each connection whose peer sent nothing for the timeout; send the others a keepalive."""
        heard, self._heard = self._heard, {}
        for conn in self._connections():
            if conn.closed:
                continue
            received = conn.stream.received
            before = heard.get(conn)
            since = before[1] if before is not None and before[0] == received else now
            if now - since >= self.timeout:
                self._silent(conn, now - since)
                continue
            self._heard[conn] = (received, since)
            conn.send_keepalive()
