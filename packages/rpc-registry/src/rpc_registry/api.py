"""The RPC API, built once on top of any :class:`~rpc_registry.protocols.RpcAgent`.

The agent moves :class:`~rpc_registry.protocols.Message` objects. This module
pickles calls and replies (tensors travel beside the payload), keeps RRef
reference counts, runs ``async_execution`` functions and gives timeouts their
meaning: seconds, ``0`` for none, ``-1`` for the agent's default.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import pickle
import re
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar, overload

import torch
from torch.distributed.distributed_c10d import Store
from torch.futures import Future
from typing_extensions import TypeVarTuple, Unpack

from . import rref as _rref
from . import slow_calls
from .constants import DEFAULT_SHUTDOWN_TIMEOUT, INSTALL_DEFAULT_BACKEND, UNSET_RPC_TIMEOUT
from .deadlines import _Call, _Deadlines
from .errors import (
    WorkerNameError,
    WorkerRefTypeError,
    _name_of,
    check_operator_arguments,
    not_initialized,
    operator_call,
)
from .functions import is_async_execution
from .grad_contexts import WITH_GRAD, GradContainer
from .pickling import _PLAIN, _PLAIN_BUDGET, _WITH_REFS, _is_plain, _Pickler, _plain_payload, _Unpickler
from .pickling import pickling_for_rpc as pickling_for_rpc
from .protocols import Message, RpcAgent, RpcBackendOptions, WorkerInfo
from .registry import _REGISTRY, BackendType, construct_rpc_backend_options, init_backend
from .rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT_S, rendezvous_store
from .rref import RRef, RRefContext, completed, copy_outcome, fail

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "AllGatherStates",
    "enable_gil_profiling",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "method_factory",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

T = TypeVar("T")
_Ts = TypeVarTuple("_Ts")
WorkerRef = WorkerInfo | str | int

_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9_:\-]+")
_MAX_NAME_LENGTH: Final = 128
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

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
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
        if timeout == UNSET_RPC_TIMEOUT:
            return self.agent.rpc_timeout
        if timeout < 0:
            raise ValueError(
                f"timeout={timeout!r}: must be seconds >= 0 (0 waits without limit), "
                "or -1 for the agent's default"
            )
        return timeout

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


_init_lock = threading.Lock()
_state: _RpcState | None = None


def _current() -> _RpcState:
    state = _state
    if state is None:
        raise not_initialized()
    return state


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name={name!r}: must be a str such as 'worker1'")
    if len(name) >= _MAX_NAME_LENGTH or not _NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"name={name!r}: a worker name must be 1 to {_MAX_NAME_LENGTH - 1} characters, "
            "each a letter, digit, '_', ':' or '-'"
        )
    return name


def _choose_backend(backend: BackendType | None, options: RpcBackendOptions | None) -> BackendType:
    if backend is not None:
        return backend
    if options is not None:
        for candidate in BackendType:
            try:
                options_type = type(construct_rpc_backend_options(candidate))
            except Exception as exc:  # noqa: BLE001 - that backend is just not a candidate
                logger.debug("cannot build options of %r: %s", candidate, exc)
                continue
            if isinstance(options, options_type):
                if candidate.name != "TENSORPIPE":
                    logger.warning(
                        "init_rpc: no backend given; using %r, whose options were passed", candidate
                    )
                return candidate
        raise TypeError(
            f"Could not infer backend for options {options!r}: no registered backend builds "
            f"options of type {type(options).__qualname__}; pass backend= explicitly"
        )
    default = _REGISTRY.get("TENSORPIPE")
    if default is None:
        raise RuntimeError(
            "init_rpc: backend=None selects the default backend TENSORPIPE, which is not "
            f"installed; install it with {INSTALL_DEFAULT_BACKEND}, or pass "
            "backend=BackendType.<NAME> of a backend registered with register_backend()"
        )
    return default


def _rendezvous(
    options: RpcBackendOptions, rank: int, world_size: int | None
) -> tuple[Store, int, int | None]:
    timeout = getattr(options, "rendezvous_timeout", None)
    if timeout is None:
        timeout = DEFAULT_RENDEZVOUS_TIMEOUT_S
    elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(
            f"rpc_backend_options.rendezvous_timeout={timeout!r}: must be seconds > 0 (how long "
            f"init_rpc waits for the other workers; default {DEFAULT_RENDEZVOUS_TIMEOUT_S:g})"
        )
    return rendezvous_store(options.init_method, rank, world_size, options.rpc_timeout, float(timeout))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def init_rpc(
    name: str,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Start RPC on this worker: rendezvous, create the backend's agent, serve requests.

    ``backend`` defaults to the type of ``rpc_backend_options`` or, without
    options, to ``BackendType.TENSORPIPE`` (``pip install tensorpipe-backend``).
    ``world_size=None`` joins a dynamic group. Options default to the
    backend's with ``init_method="env://"`` (``MASTER_ADDR``, ``MASTER_PORT``).

    As torch's, a worker waits for the others of a static group for the
    rendezvous timeout, not ``rpc_timeout`` (the limit of one call): the
    options' ``rendezvous_timeout`` seconds when they have one, else 30
    minutes. Every few seconds of the wait a warning names the ranks still
    missing; at the end a ``TimeoutError`` names those that never arrived.

    Example::

        init_rpc("worker0", rank=0, world_size=2)
        rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        shutdown()
    """
    global _state
    _check_name(name)
    # torch's wording first in both, which callers may match.
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(
            f"Argument backend must be a member of BackendType: backend={backend!r}; "
            "pass e.g. BackendType.TENSORPIPE"
        )
    if rpc_backend_options is not None and not isinstance(rpc_backend_options, RpcBackendOptions):
        raise TypeError(
            "Argument rpc_backend_options must be an instance of RpcBackendOptions (options with "
            f"rpc_timeout and init_method): rpc_backend_options={rpc_backend_options!r}; build them "
            "with construct_rpc_backend_options() or the backend's options class"
        )
    if not _is_int(rank) or rank < -1:
        raise ValueError(f"rank={rank!r}: must be an int >= 0, or -1 to read RANK (env://)")
    if world_size is not None and (not _is_int(world_size) or world_size < 1):
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1, or None for a dynamic group")
    if world_size is not None and rank >= world_size:
        raise ValueError(f"rank={rank}: must be below world_size={world_size}")
    with _init_lock:
        if _state is not None:
            raise RuntimeError("RPC is already initialized")
        # The agent's process (and the process groups beside it) exits cleanly even when one of
        # torch's threads frees a tensor after the script's last line.
        from join_core import install_exit_grace  # not at import: join_core is only needed here

        install_exit_grace()
        chosen = _choose_backend(backend, rpc_backend_options)
        options = rpc_backend_options or construct_rpc_backend_options(chosen)
        store, rank, world_size = _rendezvous(options, rank, world_size)
        agent = init_backend(
            chosen,
            store=store,
            name=name,
            rank=rank,
            world_size=world_size,
            rpc_backend_options=options,
        )
        state = _RpcState(agent)
        _rref.set_context(state.rrefs)
        # Set before the first request runs: a called function may use RPC itself, and peers
        # that finished init_rpc first may have sent requests already.
        _state = state
        try:
            agent.start(state.handle)
        except BaseException:
            _state = None
            state.close()
            raise
        me = name
        slow_calls.set_asker(
            lambda callee, timeout: rpc_async(callee, slow_calls.handler_stacks, args=(me,), timeout=timeout)
        )
    logger.info("RPC initialized: %s (rank %d) on backend %r", name, rank, chosen)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stop RPC on this worker.

    With ``graceful=True`` it first waits until every worker has called
    ``shutdown`` and no call is in flight, then releases this worker's RRefs
    and waits until their releases are done everywhere (at most ``timeout``
    seconds in all; ``0`` waits without limit), so no request is left
    without a reply and no owner frees a value a worker may still forward.
    """
    global _state
    with _init_lock:
        state = _current()
        try:
            if graceful:
                # Every worker first stops calling (as torch does): until then a handler here
                # may still forward one of this worker's RRefs, whose owner must keep the value.
                deadline = time.monotonic() + timeout if timeout > 0 else None
                state.agent.join(shutdown=False, timeout=timeout)
                state.rrefs.release_users()
                state.rrefs.flush(_left(deadline))
                state.agent.join(shutdown=True, timeout=_left(deadline))
        finally:
            slow_calls.set_asker(None)
            _state = None
            _rref.set_context(None)
            state.close()


def _left(deadline: float | None) -> float:
    """Seconds to ``deadline`` for a timeout argument (``0``: none; at least 1 ms otherwise)."""
    return 0.0 if deadline is None else max(deadline - time.monotonic(), 0.001)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of worker ``worker_name``, or of this worker when it is None."""
    return _current().agent.get_worker_info(worker_name)


def _check_callable(func: object) -> None:
    if isinstance(func, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
        raise TypeError(
            f"func={_name_of(func)}: TorchScript functions are not supported as RPC targets "
            "(TorchScript is deprecated in torch); pass the plain Python function instead "
            "(the one decorated with @torch.jit.script)"
        )
    if not callable(func):
        raise TypeError(f"func={func!r}: must be callable (a function importable by the callee)")


def is_available() -> bool:
    """Whether RPC can be used: always, this package needs no compiled extension (torch's name)."""
    return True


def get_rpc_timeout() -> float:
    """The default timeout of calls on this worker, in seconds (the agent's ``rpc_timeout``)."""
    return _current().agent.rpc_timeout


def enable_gil_profiling(flag: bool) -> None:
    """torch's switch for measuring GIL wait times in its C++ agent.

    This package has no such measurement: ``flag=False`` (torch's default)
    is accepted, ``flag=True`` raises ``NotImplementedError``.
    """
    if flag:
        raise NotImplementedError(
            "enable_gil_profiling(True): rpc_registry does not measure GIL wait times; "
            "profile with torch.profiler or py-spy instead"
        )


class AllGatherStates:
    """The per-round state of an all-gather over RPC: what arrived, and the signal to go on."""

    def __init__(self) -> None:
        self.gathered_objects: dict[str, object] = {}
        self.proceed_signal: threading.Event = threading.Event()


def method_factory(method_name: str, docstring: str | None) -> Callable[..., Any]:
    """A function that calls ``RRef.<method_name>`` on its first argument, documented by ``docstring``."""

    def method(self: RRef[Any], *args: Any, **kwargs: Any) -> Any:
        return getattr(RRef, method_name)(self, *args, **kwargs)

    method.__name__ = method_name
    method.__doc__ = docstring
    return method


# With ``args`` and no ``kwargs``, or neither, type checkers check the
# arguments against ``func``; with ``kwargs`` they check only ``func``'s result.
@overload
def rpc_async(
    to: WorkerRef,
    func: Callable[[Unpack[_Ts]], T],
    args: tuple[Unpack[_Ts]],
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
@overload
def rpc_async(
    to: WorkerRef,
    func: Callable[[], T],
    args: None = None,
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
@overload
def rpc_async(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
@overload
def rpc_async(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    *,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]: ...
def rpc_async(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[T]:
    """Run ``func(*args, **kwargs)`` on worker ``to``; the future holds its result.

    ``timeout`` is in seconds: ``0`` waits without limit, ``-1`` uses the
    agent's default. Functions decorated with ``@async_execution`` reply
    when the future they return completes.
    """
    _check_callable(func)
    check_operator_arguments(func, tuple(args or ()), dict(kwargs or {}))
    state = _current()
    request = ("call", func, tuple(args or ()), dict(kwargs or {}))
    return state.request(state.worker(to), request, state.resolve_timeout(timeout))


# With ``args`` and no ``kwargs``, or neither, type checkers check the
# arguments against ``func``; with ``kwargs`` they check only ``func``'s result.
@overload
def rpc_sync(
    to: WorkerRef,
    func: Callable[[Unpack[_Ts]], T],
    args: tuple[Unpack[_Ts]],
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
@overload
def rpc_sync(
    to: WorkerRef,
    func: Callable[[], T],
    args: None = None,
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
@overload
def rpc_sync(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
@overload
def rpc_sync(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    *,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T: ...
def rpc_sync(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> T:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result (see ``rpc_async``)."""
    _check_callable(func)
    check_operator_arguments(func, tuple(args or ()), dict(kwargs or {}))
    state = _current()
    request = ("call", func, tuple(args or ()), dict(kwargs or {}))
    callee = state.worker(to)
    slow_calls.started_waiting(id(request), callee.name, _name_of(func))
    try:
        result: T = state.request_wait(callee, request, state.resolve_timeout(timeout))
    finally:
        slow_calls.stopped_waiting(id(request))
    return result


# With ``args`` and no ``kwargs``, or neither, type checkers check the
# arguments against ``func``; with ``kwargs`` they check only ``func``'s result.
@overload
def remote(
    to: WorkerRef,
    func: Callable[[Unpack[_Ts]], T],
    args: tuple[Unpack[_Ts]],
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]: ...
@overload
def remote(
    to: WorkerRef,
    func: Callable[[], T],
    args: None = None,
    kwargs: None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]: ...
@overload
def remote(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]: ...
@overload
def remote(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    *,
    kwargs: dict[str, Any],
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]: ...
def remote(
    to: WorkerRef,
    func: Callable[..., T],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]:
    """Run ``func`` on worker ``to`` and return an :class:`RRef` to the result it keeps.

    Returns at once; a creation that fails or times out is reported by the
    first ``to_here()``.
    """
    _check_callable(func)
    check_operator_arguments(func, tuple(args or ()), dict(kwargs or {}))
    state = _current()
    return state.remote(
        state.worker(to), func, tuple(args or ()), dict(kwargs or {}), state.resolve_timeout(timeout)
    )
