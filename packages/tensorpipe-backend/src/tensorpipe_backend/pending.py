"""A call sent to a peer and waiting for its reply, and where its outcome goes.

A :class:`Pending` call is registered on its connection
(``Connection.pending``) by :class:`tensorpipe_backend.calls.Calls` and
delivered its REPLY, its ERROR or a failure (timeout, closed connection) once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.futures import Future

from rpc_registry import Message

__all__ = ["Pending", "ReplySink"]

ReplySink = Future[Message] | Callable[[Message | BaseException], None]
"""What a call's outcome goes to: a future, or a callback."""


def _fail(fut: Future[Any], exc: BaseException) -> None:
    fut.set_exception(exc)


class Pending:
    """A call waiting for its reply, and the shared-memory files its request left at the peer."""

    __slots__ = ("msg_id", "peer", "shm_tokens", "sink")

    def __init__(self, sink: ReplySink, msg_id: int, peer: str) -> None:
        self.sink: ReplySink = sink
        self.msg_id: int = msg_id
        self.peer: str = peer
        self.shm_tokens: list[bytes] = []

    def deliver(self, outcome: Message | BaseException) -> None:
        """Complete the future, or call the callback, with the reply or the error."""
        sink = self.sink
        if not isinstance(sink, Future):
            sink(outcome)
        elif isinstance(outcome, BaseException):
            _fail(sink, outcome)
        else:
            sink.set_result(outcome)

    @property
    def what(self) -> str:
        """The call, as error messages name it."""
        return f"rpc {self.msg_id} to {self.peer}"
