"""The call engine: one RPC session on top of any :class:`~rpc_registry.protocols.RpcAgent`.

The agent moves :class:`~rpc_registry.protocols.Message` objects. This module
pickles calls and replies (:mod:`rpc_registry.pickling`: tensors travel beside
the payload), keeps RRef reference counts, runs ``async_execution`` functions
and gives timeouts their meaning: seconds, ``0`` for none, ``-1`` for the
agent's default (:mod:`rpc_registry.deadlines` enforces them). The public
functions of :mod:`rpc_registry.api` start and stop the session and call into it.
"""

from __future__ import annotations

import functools
import io
import logging
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import torch
from torch.futures import Future

from . import slow_calls
from .constants import UNSET_RPC_TIMEOUT
from .deadlines import _Call, _Deadlines
from .errors import (
    WorkerNameError,
    WorkerRefTypeError,
    _name_of,
    not_initialized,
    operator_call,
)
from .functions import is_async_execution
from .grad_contexts import WITH_GRAD, GradContainer
from .pickling import _PLAIN, _PLAIN_BUDGET, _WITH_REFS, _is_plain, _Pickler, _plain_payload, _Unpickler
from .protocols import Message, RpcAgent, WorkerInfo
from .rref import RRef, RRefContext, completed, copy_outcome, fail
from .timeouts import checked_timeout

# A failed request is logged under the API's name, which the package's README documents.
logger: logging.Logger = logging.getLogger("rpc_registry.api")

# The engine of rpc_registry.api, autograd and nn: no public API.
__all__: list[str] = []

WorkerRef = WorkerInfo | str | int
"""A worker: its name, its :class:`WorkerInfo`, or its id."""

_NUM_WORKER_THREADS: Final = 16


def _failure(exc: BaseException, me: WorkerInfo, dest: WorkerInfo) -> tuple[str, object, str]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    # The callee's log shows it too, as torch prints it there: the caller may not report it.
    logger.warning(
        "%s: a request of %s failed; the error goes back to it:\n%s", me.name, dest.name, text.rstrip()
    )
    try:
        pickle.loads(pickle.dumps(exc))
        error: object = exc
    except Exception:  # noqa: BLE001 - any exception that does not round-trip is replaced
        # torch's wording, which callers may match.
        error = RuntimeError(
            f"Original exception on remote side was {type(exc).__qualname__}: {exc} "
            "(it cannot be rebuilt on the caller; the remote traceback is in the notes)"
        )
    return ("err", error, text)


class _RpcState:
    """One initialized RPC session: the agent plus everything generic around it."""

    def __init__(self, agent: RpcAgent, backward: Callable[[int, list[torch.Tensor], bool], None]) -> None:
        self.agent = agent
        # Distributed autograd's backward pass, which RRef.backward runs on the owner: passed in,
        # as rpc_registry.autograd builds on this module.
        self.backward = backward
        self._me = agent.get_worker_info()
        self.executor = ThreadPoolExecutor(_NUM_WORKER_THREADS, thread_name_prefix="rpc-registry")
        self.inline = bool(getattr(agent, "handler_may_block", False))
        # An agent's optional send_then(to, message, timeout, callback) (see RpcAgent).
        self._send_then: Callable[..., None] | None = getattr(agent, "send_then", None)
        # And its optional send_wait(to, message, timeout) -> Message.
        self._send_wait: Callable[..., Message] | None = getattr(agent, "send_wait", None)
        self.deadlines = _Deadlines()
        self.rrefs = RRefContext(self)
        self.grad = GradContainer(self._me, self.worker)

    @property
    def me(self) -> WorkerInfo:
        return self._me

    def resolve_timeout(self, timeout: float) -> float:
        if timeout == UNSET_RPC_TIMEOUT and not isinstance(timeout, bool):
            return checked_timeout("rpc_timeout", self.agent.rpc_timeout)
        return checked_timeout("timeout", timeout, ", or -1 for the agent's default")

    def worker(self, to: WorkerRef) -> WorkerInfo:
        if isinstance(to, WorkerInfo):
            return to
        if isinstance(to, str):
            return self.agent.get_worker_info(to)
        if isinstance(to, int):
            for info in self.agent.get_worker_infos():
                if info.id == to:
                    return info
            ids = sorted(info.id for info in self.agent.get_worker_infos())
            raise WorkerNameError(
                f"to={to!r}: no worker has this id (the ids are {ids}); pass a worker name instead"
            )
        raise WorkerRefTypeError(f"to={to!r}: must be a worker name, a WorkerInfo or a worker id (an int)")

    # Encoding.
    def encode(
        self,
        obj: object,
        dest: WorkerInfo,
        context_id: int | None = None,
        force: bool = False,
        reply: bool = False,
    ) -> Future[Message]:
        """Pickle ``obj`` for ``dest``; completes once forks it creates are known to their owners.

        Inside distributed autograd context ``context_id``, tensors that
        require grad are recorded (see :mod:`rpc_registry.grad_contexts`);
        ``force`` sends the context along even without such tensors.
        ``reply``: ``obj`` answers a request of ``dest`` (see ``RRefContext.to_wire``).
        """
        if _is_plain(obj, _PLAIN_BUDGET) >= 0:
            # Nothing in it can be a tensor or an RRef: the C pickler alone.
            message = Message(_plain_payload(obj))
            if context_id is not None:
                message = self.grad.on_send(context_id, message, dest, force)
            return completed(message)
        buffer = io.BytesIO()
        buffer.write(bytes((_WITH_REFS,)))
        pickler = _Pickler(buffer, self.rrefs, dest, reply)
        pickler.dump(obj)
        message = Message(buffer.getvalue(), tuple(pickler.tensors))
        if context_id is not None:
            message = self.grad.on_send(context_id, message, dest, force)
        # Neither a fork registration nor the message itself may overtake the creation of an
        # RRef on its owner: the owner may handle two requests of one peer at once, the later first.
        unconfirmed = [r._created for r in pickler.rrefs if r._created is not None and not r._created.done()]
        if not pickler.forks and not unconfirmed:
            return completed(message)
        return self._after_forks(message, pickler, unconfirmed)

    def _after_forks(
        self, message: Message, pickler: _Pickler, unconfirmed: list[Future[Any]]
    ) -> Future[Message]:
        """``message`` once the RRefs in it exist on their owners, which know of its forks."""
        if not unconfirmed:
            return self._register_forks(message, pickler)
        out: Future[Message] = Future()
        torch.futures.collect_all(unconfirmed).add_done_callback(
            lambda _: self._register_forks(message, pickler).add_done_callback(lambda f: copy_outcome(f, out))
        )
        return out

    def _register_forks(self, message: Message, pickler: _Pickler) -> Future[Message]:
        if not pickler.forks:
            return completed(message)
        registrations = [
            self.request(owner, ("fork", rref_id, fork_id), self.agent.rpc_timeout)
            for owner, rref_id, fork_id in pickler.forks
        ]
        out: Future[Message] = Future()
        rrefs = pickler.rrefs  # keeps the sender's references alive until the send

        def on_registered(_: Future[list[Future[Any]]]) -> None:
            try:
                for registration in registrations:
                    registration.wait()
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                fail(out, exc)
            else:
                out.set_result(message)
            rrefs.clear()

        torch.futures.collect_all(registrations).add_done_callback(on_registered)
        return out

    def decode(self, message: Message, request: bool = False) -> tuple[Any, int | None]:
        """The object in ``message`` and the autograd context it was sent in (if any).

        A ``request`` creates that context here when it is new.
        """
        context_id = None
        if message.payload[:1] == bytes((WITH_GRAD,)):
            message, context_id = self.grad.on_receive(message, create=request)
        return self._unpickle(message), context_id

    def _unpickle(self, message: Message) -> Any:
        payload = message.payload
        kind = payload[0] if payload else -1
        if kind == _PLAIN:
            return pickle.loads(memoryview(payload)[1:])
        if kind != _WITH_REFS:
            raise ValueError(f"malformed RPC payload: unknown kind {kind} (a peer of another version?)")
        return _Unpickler(message, self.rrefs).load()

    # Caller side.
    def request(
        self, to: WorkerInfo, request: tuple[object, ...], timeout: float, in_context: bool = True
    ) -> Future[Any]:
        """Send ``request``; the future holds the decoded reply.

        A request made inside a distributed autograd context carries it,
        unless ``in_context=False`` (the autograd layer's own messages).
        """
        result: Future[Any] = Future()
        context_id = self.grad.current_id() if in_context else None
        plain = context_id is None and to.name != self._me.name and _is_plain(request, _PLAIN_BUDGET) >= 0
        if plain and self._send_then is not None:
            # The common case, without the futures of encoding (nothing in it is a tensor or
            # an RRef) and without a deadline here: the agent times send_then calls out.
            try:
                self._send_then(
                    to, Message(_plain_payload(request)), timeout, functools.partial(self._finish_now, result)
                )
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                fail(result, exc)
            return result
        call = self.deadlines.add(result, timeout, (self._me.name, to.name, request[0], request[1]))
        if plain:
            try:
                reply = self.agent.send(to, Message(_plain_payload(request)), timeout)
                reply.add_done_callback(functools.partial(self._complete, call=call))
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self._settle(call, None, exc)
            return result
        try:
            encoded = self.encode(request, to, context_id, force=True)
        except BaseException:
            self.deadlines.claim(call)
            raise
        self._send_encoded(call, to, request, encoded, timeout)
        return result

    def _send_encoded(
        self,
        call: _Call,
        to: WorkerInfo,
        request: tuple[object, ...],
        encoded: Future[Message],
        timeout: float,
    ) -> None:
        """Send ``request``, pickled as ``encoded`` holds it once done; settle ``call`` with the reply."""

        def send(done: Future[Message]) -> None:
            try:
                message = done.wait()
                if to.name == self._me.name:
                    reply = self.handle(self._me, message, inline=False)
                else:
                    reply = self.agent.send(to, message, timeout)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self._settle(call, None, exc)
                return
            # The request (with the RRefs in it) lives until the reply: the callee, maybe an
            # RRef's owner, must decode it before this worker's deletion of the RRef arrives.
            reply.add_done_callback(functools.partial(self._complete_keeping, call=call, keep=request))

        if encoded.done():
            send(encoded)
        else:
            encoded.add_done_callback(send)

    def request_wait(self, to: WorkerInfo, request: tuple[object, ...], timeout: float) -> Any:
        """``request``'s result, waited for in this thread (its error raised)."""
        send_wait = self._send_wait
        if send_wait is None or to.name == self._me.name or self.grad.current_id() is not None:
            return self.request(to, request, timeout).wait()
        if _is_plain(request, _PLAIN_BUDGET) >= 0:
            message = Message(_plain_payload(request))
        else:
            encoded = self.encode(request, to)
            if not encoded.done():  # RRefs in it wait for their owners: sent from a callback
                result: Future[Any] = Future()
                call = self.deadlines.add(result, timeout, (self._me.name, to.name, request[0], request[1]))
                self._send_encoded(call, to, request, encoded, timeout)
                return result.wait()
            message = encoded.wait()
        # A call to a peer, ready to go: the agent may read the reply in this thread. The
        # request (with any RRefs in it) lives in this frame until the reply.
        value, error = self._reply_value(send_wait(to, message, timeout))
        if error is not None:
            raise error
        return value

    def _call_now(
        self, request: tuple[Any, ...], sender: WorkerInfo, context_id: int | None = None
    ) -> Future[Message]:
        """Run a plain call in this thread and encode its reply (no future until the reply)."""
        _, func, args, kwargs = request
        ident = threading.get_ident()
        slow_calls.running[ident] = (sender.name, _name_of(func), time.monotonic())
        try:
            payload: tuple[object, ...] = ("ok", operator_call(func, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            payload = _failure(exc, self._me, sender)
        finally:
            slow_calls.running.pop(ident, None)
        return self._encode_reply(payload, sender, context_id)

    def _settle(self, call: _Call, value: object, error: BaseException | None) -> None:
        result = self.deadlines.claim(call)
        if result is None:
            return  # timed out before
        if error is None:
            result.set_result(value)
        else:
            fail(result, error)

    def _complete(self, reply: Future[Message], call: _Call) -> None:
        try:
            outcome: Message | BaseException = reply.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            outcome = exc
        self._finish(call, outcome)

    def _complete_keeping(self, reply: Future[Message], call: _Call, keep: object) -> None:
        """``_complete``, called with ``keep`` (the request) so that it lives until the reply."""
        self._complete(reply, call)

    def _finish(self, call: _Call, outcome: Message | BaseException) -> None:
        """Settle ``call`` with the decoded reply ``outcome`` (or the agent's error)."""
        self._settle(call, *self._reply_value(outcome))

    def _finish_now(self, result: Future[Any], outcome: Message | BaseException) -> None:
        """Complete ``result``, which no deadline here tracks, with the reply ``outcome``."""
        value, error = self._reply_value(outcome)
        if error is None:
            result.set_result(value)
        else:
            fail(result, error)

    def _reply_value(self, outcome: Message | BaseException) -> tuple[object, BaseException | None]:
        """The call's value, or its error: the agent's, the decoding's or the remote one."""
        if isinstance(outcome, BaseException):
            return None, outcome
        try:
            (status, *body), _ = self.decode(outcome)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            return None, exc
        if status == "ok":
            return body[0], None
        error, remote_traceback = body
        add_note = getattr(error, "add_note", None)
        if add_note is not None:
            add_note(f"Raised on the remote worker:\n{remote_traceback}")
        return None, error

    def remote(
        self,
        to: WorkerInfo,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> RRef[Any]:
        rref_id = self.rrefs.new_id()
        if to == self._me:
            value = self.rrefs.create_owned(rref_id, None)
            context_id = self.grad.current_id()
            if context_id is not None:
                func = self.grad.bind(context_id, func)
            self.run(func, args, kwargs).add_done_callback(lambda f: copy_outcome(f, value))
            return RRef._make(self.rrefs, to, rref_id, None, None)
        fork_id = self.rrefs.new_id()
        created = self.request(to, ("remote", func, args, kwargs, rref_id, fork_id), timeout)
        return self.rrefs.track_user(RRef._make(self.rrefs, to, rref_id, fork_id, created))

    # Callee side.
    def handle(self, sender: WorkerInfo, message: Message, inline: bool | None = None) -> Future[Message]:
        """The agent's request handler; bookkeeping happens before it returns.

        A call runs in the calling thread when ``inline`` (default: when the
        agent's ``handler_may_block``), else on this module's worker threads.
        """
        inline = self.inline if inline is None else inline
        context_id = None
        try:
            try:
                request, context_id = self.decode(message, request=True)
            except (AttributeError, ImportError, pickle.UnpicklingError) as exc:
                # torch's wording first, which callers may match.
                raise RuntimeError(
                    "RPC pickler does not serialize function code: "
                    f"{self._me.name} could not load the request of {sender.name} "
                    f"({type(exc).__name__}: {exc}); define the function in a module both import"
                ) from exc
            if context_id is not None and request[0] in ("call", "remote"):
                # The called function runs inside the caller's context: its own calls join it.
                request = (request[0], self.grad.bind(context_id, request[1]), *request[2:])
            if inline and request[0] == "call" and not is_async_execution(request[1]):
                return self._call_now(request, sender, context_id)
            outcome = self._dispatch(request, inline, sender.name)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            outcome = Future()
            fail(outcome, exc)
        if outcome.done():
            return self._reply(outcome, sender, context_id)
        reply: Future[Message] = Future()
        outcome.add_done_callback(
            lambda f: self._reply(f, sender, context_id).add_done_callback(lambda e: copy_outcome(e, reply))
        )
        return reply

    def _dispatch(self, request: tuple[Any, ...], inline: bool, caller: str = "") -> Future[Any]:
        kind = request[0]
        if kind == "call":
            _, func, args, kwargs = request
            return self.run(func, args, kwargs, inline=inline, caller=caller)
        if kind == "remote":
            func, args, kwargs, rref_id, fork_id = request[1:]
            value = self.rrefs.create_owned(rref_id, fork_id)
            self.run(func, args, kwargs, inline=inline, caller=caller).add_done_callback(
                lambda f: copy_outcome(f, value)
            )
            return completed(None)
        if kind == "fetch":
            return self.rrefs.value_of(request[1])
        if kind == "fork":
            self.rrefs.add_fork(request[1], request[2])
            return completed(None)
        if kind == "delete":
            self.rrefs.delete_fork(request[1], request[2])
            return completed(None)
        raise ValueError(f"unknown request kind {kind!r}")

    def _reply(self, outcome: Future[Any], dest: WorkerInfo, context_id: int | None) -> Future[Message]:
        try:
            payload: tuple[object, ...] = ("ok", outcome.value())
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            payload = _failure(exc, self._me, dest)
        return self._encode_reply(payload, dest, context_id)

    def _encode_reply(
        self, payload: tuple[object, ...], dest: WorkerInfo, context_id: int | None = None
    ) -> Future[Message]:
        try:
            return self.encode(payload, dest, context_id, reply=True)
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
            return self.encode(_failure(exc, self._me, dest), dest, reply=True)

    def run(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inline: bool = False,
        caller: str = "",
    ) -> Future[Any]:
        """Run ``func`` here (``inline``) or on a worker thread; an ``async_execution`` result is awaited."""
        out: Future[Any] = Future()

        def job() -> None:
            ident = threading.get_ident()
            slow_calls.running[ident] = (caller, _name_of(func), time.monotonic())
            try:
                result = operator_call(func, args, kwargs)
                if not is_async_execution(func):
                    out.set_result(result)
                # Future.then() returns torch's C++ future type, so check by behaviour.
                elif callable(getattr(result, "add_done_callback", None)):
                    result.add_done_callback(lambda f: copy_outcome(f, out))
                else:
                    # torch's wording, which callers may match.
                    raise RuntimeError(
                        "Functions decorated with @rpc.async_function must return a "
                        f"torch.futures.Future object, but {_name_of(func)} (decorated with "
                        f"@async_execution) returned {type(result).__qualname__}"
                    )
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                fail(out, exc)
            finally:
                slow_calls.running.pop(ident, None)

        if inline:
            job()
        else:
            self.executor.submit(job)
        return out

    def close(self) -> None:
        try:
            self.agent.shutdown()
        finally:
            self.rrefs.close()
            self.grad.clear()
            self.deadlines.stop()
            self.executor.shutdown(wait=False, cancel_futures=True)


# The session: set by rpc_registry.api's init_rpc and shutdown (under their lock), None between.
_state: _RpcState | None = None


def _current() -> _RpcState:
    state = _state
    if state is None:
        raise not_initialized()
    return state
