"""Helpers of the multi-process tests: worker bodies and the functions called remotely.

Spawned workers import this module by name, so everything they run lives here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.synchronize
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future

from rpc_registry import (
    BackendType,
    RequestHandler,
    RRef,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from rpc_registry.functions import async_execution
from tensorpipe_backend import (
    TensorPipeAgent,
    TensorPipeRpcBackendOptions,
    ensure_registered,
    get_current_agent,
)

TOKEN = "test-secret-of-this-job"
# Workers fork from a server that imported torch (and, where torch has no CUDA to spoil for the
# forked workers, these packages) once: a spawned worker spends seconds of CPU importing them.
# ``spawned`` gives each worker the environment of the moment it starts.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(
    ["torch"]
    if torch.backends.cuda.is_built()
    else ["torch", "rpc_registry", "tensorpipe_backend", "tpb_workers"]
)


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def backend() -> BackendType:
    """``BackendType.TENSORPIPE``, found through the entry point or registered from the source tree."""
    return ensure_registered()


def options(init_method: str, **kwargs: Any) -> TensorPipeRpcBackendOptions:
    """Options with the test secret and a 20 s default timeout, unless overridden."""
    kwargs.setdefault("rpc_timeout", 20.0)
    kwargs.setdefault("auth_token", TOKEN)
    kwargs.setdefault("num_worker_threads", 4)
    return TensorPipeRpcBackendOptions(init_method=init_method, **kwargs)


def fake_cuda_devices(count: int) -> None:
    """Make torch report ``count`` CUDA devices, so device maps validate on a CPU-only machine."""
    torch.cuda.device_count = lambda: count


@contextmanager
def spawned(
    targets: Sequence[tuple[Callable[..., None], tuple[Any, ...]]], timeout: float = 30.0
) -> Iterator[list[multiprocessing.context.ForkServerProcess]]:
    """Run each ``(target, args)`` in a new process; none is left running afterwards."""
    env = dict(os.environ)
    processes = [
        CONTEXT.Process(target=_in_env, args=(env, target, args), daemon=True) for target, args in targets
    ]
    for process in processes:
        process.start()
    try:
        yield processes
    finally:
        for process in processes:
            process.join(timeout=timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def _in_env(env: dict[str, str], target: Callable[..., None], args: tuple[Any, ...]) -> None:
    """``target(*args)`` with the environment ``env`` (the forkserver's is that of its start)."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)


# Worker bodies.
def serve(name: str, rank: int, world_size: int, init_method: str) -> None:
    """Join a static group and serve until every worker shuts down."""
    init_rpc(name, backend(), rank, world_size, options(init_method))
    shutdown(graceful=True, timeout=60.0)


def as_another_host() -> None:
    """Make this process share no host identity with its peers (as where ``/dev/shm`` is not
    usable): no Unix socket and no shared memory, so they talk over TCP, with a lane for large
    tensors."""
    import tensorpipe_backend.agent

    tensorpipe_backend.agent.host_identity = lambda: ""  # type: ignore[attr-defined]


def serve_as_another_host(name: str, rank: int, world_size: int, init_method: str) -> None:
    """:func:`serve`, from a process that looks like a host of its own."""
    as_another_host()
    serve(name, rank, world_size, init_method)


def lanes() -> dict[str, bool]:
    """Per connected peer, whether this worker's connection to it has a lane attached."""
    peers = get_current_agent()._peers
    assert peers is not None
    return {name: conn.lane.sock is not None for name, conn in peers.conns.items()}


def local_port(peer: str) -> int:
    """The local port of this worker's connection to ``peer``."""
    peers = get_current_agent()._peers
    assert peers is not None
    port: int = peers.conns[peer].sock.getsockname()[1]
    return port


def wait_for_lanes(expected: dict[str, bool], timeout: float = 10.0) -> dict[str, bool]:
    """:func:`lanes` once it is ``expected`` (lanes are dialled on a thread), or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while (found := lanes()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def shut_down_when(name: str, rank: int, world_size: int, init_method: str, event: Any) -> None:
    """Join a static group, wait for ``event`` (an Event), then shut down gracefully."""
    init_rpc(name, backend(), rank, world_size, options(init_method))
    event.wait(60)
    shutdown(graceful=True, timeout=60.0)


def forward_kept_when(
    name: str, rank: int, world_size: int, init_method: str, holder: str, go: Any, results: Any
) -> None:
    """Join a static group; once ``go`` is set, have ``holder`` send the RRef it keeps here;
    report what that gave ("ok" or the error), then shut down."""
    init_rpc(name, backend(), rank, world_size, options(init_method))
    go.wait(60)
    try:
        value = rpc_sync(holder, forward_kept, args=(name,))
        results.put("ok" if torch.equal(value, torch.ones(2)) else f"wrong value {value}")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(f"{type(exc).__name__}: {exc}")
    shutdown(graceful=True, timeout=60.0)


def serve_late(
    name: str, rank: int, world_size: int, init_method: str, delay: float, rpc_timeout: float
) -> None:
    """:func:`serve`, starting ``delay`` seconds late, with a short call timeout."""
    time.sleep(delay)
    init_rpc(name, backend(), rank, world_size, options(init_method, rpc_timeout=rpc_timeout))
    shutdown(graceful=True, timeout=60.0)


def serve_until(name: str, rank: int, world_size: int, init_method: str, done: Any) -> None:
    """Serve until ``done`` (an Event) is set, then stop without waiting for the others."""
    init_rpc(name, backend(), rank, world_size, options(init_method))
    done.wait(60)
    shutdown(graceful=False)


def shut_down_beside_a_stopped_peer(
    init_method: str, results: Any, stopped: Any, graceful_timeout: float | None = None
) -> None:
    """s0, without liveness watch: once s1 is ``stopped`` (SIGSTOP), fill the connection to it
    from a thread (echo calls of 8 MiB that s1 never reads), then ``shutdown(graceful=False)``
    (or, with ``graceful_timeout``, a graceful one with that timeout); report
    ``(outcome, seconds, warnings)``."""
    warnings = _agent_warnings()
    init_rpc("s0", backend(), 0, 2, options(init_method, liveness_timeout=0))
    rpc_sync("s1", whoami)
    results.put("ready")
    stopped.wait(60)
    blob = bytes(8 << 20)
    filler = threading.Thread(
        target=lambda: [rpc_async("s1", echo, args=(blob,), timeout=0) for _ in range(8)], daemon=True
    )
    filler.start()
    filler.join(3)  # blocked on the full connection by now
    if graceful_timeout is None:
        outcome, seconds = _timed_error(lambda: shutdown(graceful=False))
    else:
        outcome, seconds = _timed_error(lambda: shutdown(graceful=True, timeout=graceful_timeout))
    results.put((outcome, seconds, warnings))


def serve_until_liveness(
    name: str, rank: int, world_size: int, init_method: str, done: Any, liveness_timeout: float
) -> None:
    """:func:`serve_until` with a liveness timeout of its own."""
    init_rpc(name, backend(), rank, world_size, options(init_method, liveness_timeout=liveness_timeout))
    done.wait(60)
    shutdown(graceful=False)


def survivor_whose_callback_blocks(
    name: str, rank: int, world_size: int, init_method: str, results: Any
) -> None:
    """Calls k2, which the test then stops: the liveness watch fails the call, whose callback
    blocks for three liveness timeouts. Then calls k1, and reports what came back."""
    init_rpc(name, backend(), rank, world_size, options(init_method, liveness_timeout=1.0))
    done = threading.Event()

    def block(_: Future[int]) -> None:
        time.sleep(3.0)
        done.set()

    rpc_async("k2", sleep_then, args=(60.0, 1)).add_done_callback(block)
    results.put(("calling",))
    done.wait(30)
    try:
        outcome = rpc_sync("k1", whoami, timeout=10)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = f"{type(exc).__name__}: {exc}"
    results.put(("report", outcome))
    shutdown(graceful=False)


def join_holding_the_membership_token_forever(name: str, rank: int, init_method: str, holding: Any) -> None:
    """Join the dynamic group and stop right after taking its membership token (``holding`` is set
    then), as a worker killed while joining would leave it."""
    import tensorpipe_backend.agent

    def hold(store: Any) -> bool:
        holding.set()
        time.sleep(120)
        return False

    tensorpipe_backend.agent.static_group_met = hold  # type: ignore[attr-defined]
    init_rpc(name, backend(), rank, None, options(init_method))


def join_then_leave_when_told(name: str, rank: int, init_method: str, results: Any, go: Any) -> None:
    """Join the dynamic group, report ``("joined", name)``, and when ``go`` is set shut down
    gracefully with no time limit; report ``("left", name, the members it saw before)``."""
    init_rpc(name, backend(), rank, None, options(init_method))
    results.put(("joined", name))
    go.wait(60)
    seen = sorted(info.name for info in get_current_agent().get_worker_infos())
    shutdown(graceful=True)
    results.put(("left", name, seen))


def join_call_then_leave(
    name: str, rank: int, init_method: str, to: str, results: Any, times: int = 1
) -> None:
    """``times`` over: join the dynamic group, report the members this worker sees and what ``to``
    answers to ``whoami``, leave."""
    for _ in range(times):
        init_rpc(name, backend(), rank, None, options(init_method))
        seen = sorted(info.name for info in get_current_agent().get_worker_infos())
        results.put((seen, _error_text(lambda: rpc_sync(to, whoami)) if to != name else "no error"))
        shutdown(graceful=True, timeout=10.0)


def dial_while_shutting_down(
    name: str, rank: int, world_size: int, init_method: str, results: Any, done: Any
) -> None:
    """w1: its first call to w2 (to which it has no connection yet) shuts the agent down (from
    another thread) between the handshake and the connection's start; reports the call's outcome,
    the connections then kept, and whether a reader thread of w2 still runs."""
    import tensorpipe_backend.peers

    peers_module: Any = tensorpipe_backend.peers  # its handshake is replaced for a moment
    init_rpc(name, backend(), rank, world_size, options(init_method))
    agent: Any = get_current_agent()
    peers = agent._peers
    handshake = peers_module.client_handshake

    def handshake_then_shut_down(*args: Any) -> Any:
        outcome = handshake(*args)
        threading.Thread(target=shutdown, kwargs={"graceful": False}).start()
        deadline = time.monotonic() + 10
        while not peers.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        return outcome

    peers_module.client_handshake = handshake_then_shut_down
    outcome = _error_text(lambda: rpc_sync("w2", whoami, timeout=5))
    time.sleep(0.5)
    readers = [t.name for t in threading.enumerate() if t.name.startswith("read-w2")]
    results.put((outcome, sorted(peers.conns), readers))
    done.set()


def init_then_shut_down(name: str, rank: int, world_size: int, init_method: str, results: Any) -> None:
    """Join a static group and shut down gracefully at once; report how long the shutdown took."""
    init_rpc(name, backend(), rank, world_size, options(init_method))
    start = time.monotonic()
    shutdown(graceful=True, timeout=10.0)
    results.put((name, time.monotonic() - start))


def init_reporting_error(name: str, rank: int, world_size: int, init_method: str, results: Any) -> None:
    """Join a static group; report the error of init_rpc as "Type: message" (None: it succeeded)."""
    try:
        init_rpc(name, backend(), rank, world_size, options(init_method))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(f"{type(exc).__name__}: {exc}")
        return
    results.put(None)
    shutdown(graceful=True, timeout=10.0)


def ask_whoami(via: str) -> str:
    """Ask ``via`` for its name: a called function that uses RPC itself."""
    return str(rpc_sync(via, whoami))


def call_at_once(name: str, rank: int, world_size: int, init_method: str, results: Any) -> None:
    """Right after init_rpc, have the next worker ask the one after it for its name."""
    init_rpc(name, backend(), rank, world_size, options(init_method))
    following, after = f"a{(rank + 1) % world_size}", f"a{(rank + 2) % world_size}"
    answer = _error_text(lambda: results.put((name, rpc_sync(following, ask_whoami, args=(after,)))))
    if answer != "no error":
        results.put((name, answer))
    shutdown(graceful=True, timeout=30.0)


def call_then_shut_down(name: str, rank: int, world_size: int, init_method: str, results: Any) -> None:
    """Send calls and shut down at once; report what the calls returned after the shutdown."""
    init_rpc(name, backend(), rank, world_size, options(init_method))
    futures = [rpc_async("g2", sleep_then, args=(0.3, i)) for i in range(4)]
    futures.append(rpc_async("g0", sleep_then, args=(0.3, 10)))
    shutdown(graceful=True, timeout=60.0)
    results.put((name, [f.value() if f.done() else None for f in futures]))


def serve_once_queued(
    name: str, rank: int, world_size: int, init_method: str, queued: int, done: Any
) -> None:
    """Join a static group, but hand requests to the handler only once ``queued`` of them have
    arrived (they wait in their peers' strands meanwhile, at most 30 s); serve until ``done`` (an
    Event) is set, then shut down gracefully."""
    start = TensorPipeAgent.start

    def start_once_queued(agent: TensorPipeAgent, handler: RequestHandler) -> None:
        deadline = time.monotonic() + 30.0
        while agent._calls.active() < queued and time.monotonic() < deadline:
            time.sleep(0.01)
        start(agent, handler)

    setattr(TensorPipeAgent, "start", start_once_queued)  # noqa: B010 - a method replaced, which mypy refuses
    init_rpc(name, backend(), rank, world_size, options(init_method))
    done.wait(60)
    shutdown(graceful=True, timeout=30.0)


def call_s1_scenario(
    init_method: str, results: Any, done: Any, calls: list[tuple[Callable[..., object], tuple[Any, ...]]]
) -> None:
    """s0: sends s1 (:func:`serve_once_queued`) the ``calls`` (function, arguments) at once, in
    order; reports what the first returned, or its error, once all are done."""
    init_rpc("s0", backend(), 0, 2, options(init_method))
    futures = [rpc_async("s1", fn, args=args, timeout=20.0) for fn, args in calls]
    outcomes: list[object] = []
    for future in futures:
        try:
            outcomes.append(future.wait())
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcomes.append(f"{type(exc).__name__}: {exc}")
    results.put(outcomes[0])
    done.set()
    shutdown(graceful=True, timeout=30.0)


def call_back_through(via: str, timeout: float) -> tuple[str, str]:
    """Call ``via``, which calls this worker back: a request that arrives from ``via`` while this
    call waits. The name of the thread that ran this call, and what the call back returned."""
    me = get_worker_info().name
    answer: str = rpc_sync(via, ask_name, args=(me, timeout), timeout=3 * timeout)
    return threading.current_thread().name, answer


def ask_name(of: str, timeout: float) -> str:
    """Ask ``of`` for its name, waiting at most ``timeout`` s."""
    return str(rpc_sync(of, whoami, timeout=timeout))


RELEASED = threading.Event()


def wait_for_release(timeout: float) -> tuple[str, bool]:
    """Wait at most ``timeout`` s for a call of :func:`release`, without calling out: the name of
    the thread that ran this call, and whether the release came."""
    return threading.current_thread().name, RELEASED.wait(timeout)


def release() -> None:
    """End :func:`wait_for_release`."""
    RELEASED.set()


def dynamic_member(
    name: str,
    rank: int,
    init_method: str,
    device_maps: dict[str, dict[int, int]],
    leave: multiprocessing.synchronize.Event,
    joined: multiprocessing.synchronize.Event,
) -> None:
    """Join a dynamic group with ``device_maps`` (on 2 fake CUDA devices), say so once ``init_rpc``
    returned (every member then knows this one), leave when told."""
    fake_cuda_devices(2)
    init_rpc(name, backend(), rank, None, options(init_method, device_maps=device_maps))
    joined.set()
    leave.wait(60)
    shutdown(graceful=True, timeout=30.0)


# Functions called on other workers.
def add(x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """``(x + y) * scale``."""
    return (x + y) * scale


def describe(x: torch.Tensor) -> tuple[str, list[int], bool, bool]:
    """What arrived: dtype, shape, whether contiguous and whether it requires grad."""
    return str(x.dtype), list(x.shape), x.is_contiguous(), x.requires_grad


def nested_add_one(via: str, x: torch.Tensor) -> torch.Tensor:
    """Ask ``via`` for ``x + 1`` and return twice that: a call from within a call."""
    return rpc_sync(via, torch.add, args=(x, 1)) * 2


class SlowToLoad:
    """Takes ``seconds`` to unpickle, holding up the handling of the request that carries it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[Callable[[float], SlowToLoad], tuple[float]]:
        return _load_slowly, (self.seconds,)


def _load_slowly(seconds: float) -> SlowToLoad:
    time.sleep(seconds)
    return SlowToLoad(seconds)


def add_ignoring(x: torch.Tensor, n: float, _ignored: object) -> torch.Tensor:
    return x + n


def local_value_after(_slow: object, rref: RRef[torch.Tensor]) -> torch.Tensor:
    return rref.local_value()


KEPT: list[RRef[torch.Tensor]] = []


def keep(rref: RRef[torch.Tensor]) -> None:
    """Keep ``rref`` in this worker (see :func:`forward_kept`)."""
    KEPT.append(rref)


def forward_kept(dest: str) -> torch.Tensor:
    """Send the kept RRef to ``dest`` (neither this worker nor its owner), which fetches its value."""
    value: torch.Tensor = rpc_sync(dest, RRef.to_here, args=(KEPT[0],))
    return value


def send_to_owner_then_drop(owner: str) -> torch.Tensor:
    """Send this worker's only reference to a value to its owner, dropping it while the owner unpickles."""
    rref = remote(owner, torch.ones, args=([2],))
    rref.to_here()
    future = rpc_async(owner, local_value_after, args=(SlowToLoad(0.2), rref))
    del rref
    gc.collect()
    return future.wait()


def return_an_rref_of(owner: str) -> tuple[SlowToLoad, RRef[torch.Tensor]]:
    """This worker's only reference to a value on ``owner`` (the caller), returned to it slowly."""
    rref = remote(owner, torch.ones, args=([2],))
    rref.to_here()
    return SlowToLoad(0.2), rref


def remote_pair_on(owner: str) -> tuple[RRef[torch.Tensor], RRef[torch.Tensor]]:
    """Two RRefs of values on ``owner``, returned at once while ``owner`` still unpickles the requests."""
    slow = SlowToLoad(0.2)
    return (
        remote(owner, add_ignoring, args=(torch.ones(2), 1, slow)),
        remote(owner, add_ignoring, args=(torch.ones(2), 2, slow)),
    )


def peer_transports() -> dict[str, str]:
    """How the callee reaches each of its peers."""
    return get_current_agent().peer_transports


def raise_key_error(key: str) -> None:
    """Raise ``KeyError(key)`` on the callee."""
    raise KeyError(key)


def sleep_then(seconds: float, value: int) -> int:
    """Sleep, then return ``value``."""
    time.sleep(seconds)
    return value


def ask_back(via: str, count: int) -> list[tuple[int, str]]:
    """Call ``via`` ``count`` times while ``via`` waits for this call's reply: what each call
    returned and the name of the thread of ``via`` that ran it."""
    return [(sleep_then(0.0, i), rpc_sync(via, thread_name)) for i in range(count)]


NOTED: list[int] = []


def note(value: int) -> int:
    """Record ``value`` in this process, in call order, and return it."""
    NOTED.append(value)
    return value


def flood(via: str, count: int) -> list[int | str]:
    """Call ``note(i)`` on ``via`` for ``i`` in ``range(count)``, all at once; the values, or the
    errors' text."""
    futures = [rpc_async(via, note, args=(i,), timeout=20) for i in range(count)]
    return [_outcome(future) for future in futures]


def echo(value: bytes) -> bytes:
    """Return ``value``."""
    return value


def echo_flood(via: str, count: int, size: int) -> int:
    """Send ``via`` ``count`` echo calls of ``size`` bytes each, all at once; how many came back whole."""
    blob = bytes(range(256)) * (size // 256)
    futures = [rpc_async(via, echo, args=(blob,), timeout=20) for _ in range(count)]
    return sum(future.wait() == blob for future in futures)


def set_stuck_ticks(ticks: int) -> int:
    """Make this worker's watch relieve a busy thread after ``ticks`` ticks; the former number."""
    import tensorpipe_backend.watch

    previous = tensorpipe_backend.watch.STUCK_TICKS
    tensorpipe_backend.watch.STUCK_TICKS = ticks  # type: ignore[misc]
    return previous


def _outcome(future: Future[int]) -> int | str:
    try:
        return future.wait()
    except Exception as exc:  # noqa: BLE001 - the text is the result
        return f"{type(exc).__name__}: {exc}"


def thread_name() -> str:
    """The name of the callee's thread that runs this call."""
    return threading.current_thread().name


def pid() -> int:
    """The callee's process id."""
    return os.getpid()


def whoami() -> str:
    """The callee's worker name."""
    return get_worker_info().name


def address() -> tuple[str, int]:
    """Where the callee's agent listens."""
    return get_current_agent().address


def reverse_maps() -> dict[str, dict[str, str]]:
    """The callee agent's reverse device maps, as strings."""
    maps = get_current_agent().reverse_device_maps
    return {peer: {str(k): str(v) for k, v in map_.items()} for peer, map_ in maps.items()}


@async_execution
def async_double(via: str, x: torch.Tensor) -> Future[torch.Tensor]:
    """A future of ``2 * (x + 1)``, computed by ``via``."""
    fut: Future[torch.Tensor] = rpc_async(via, torch.add, args=(x, 1))
    return fut.then(lambda f: f.wait() * 2)


class CreateFile:
    """Unpickling this creates a file: what an attacker's payload would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def armed_payload(path: Path) -> bytes:
    """A pickle that creates ``path`` when loaded."""
    return pickle.dumps(CreateFile(path))


# Scenario drivers: rpc_registry numbers the sessions of a process in its store
# keys, so a process on its second session cannot meet freshly spawned ones;
# each multi-process scenario therefore runs entirely in spawned workers.
def _error_text(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the text is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def kill_scenario_caller(init_method: str, sent: Any, killed: Any, results: Any, release_k1: Any) -> None:
    """k0: calls k2 (which the test kills) and k1; reports how the calls ended."""
    init_rpc("k0", backend(), 0, 3, options(init_method))
    pending = [rpc_async("k2", sleep_then, args=(30.0, i), timeout=0) for i in range(3)]
    survivor = rpc_async("k1", sleep_then, args=(1.0, 1))
    # A thread in rpc_sync reads k2's socket itself while it waits for the reply.
    sync_error: list[str] = []
    waiter = threading.Thread(
        target=lambda: sync_error.append(
            _error_text(lambda: rpc_sync("k2", sleep_then, args=(30.0, 9), timeout=0))
        )
    )
    waiter.start()
    time.sleep(0.3)
    sent.put("sent")
    killed.wait(30)
    start = time.monotonic()
    errors = [_error_text(future.wait) for future in pending]
    waiter.join(10)
    errors += sync_error
    elapsed = time.monotonic() - start
    neg = rpc_sync("k1", torch.neg, args=(torch.ones(2),))
    results.put((errors, elapsed, survivor.wait(), neg.tolist()))
    release_k1.set()
    shutdown(graceful=False)


def graceful_scenario_caller(init_method: str, results: Any) -> None:
    """g0: sends a slow call and shuts down at once; reports the call's value after shutdown."""
    init_rpc("g0", backend(), 0, 3, options(init_method))
    mine = rpc_async("g2", sleep_then, args=(0.5, 7))
    shutdown(graceful=True, timeout=60.0)
    results.put(("g0", mine.value() if mine.done() else None))


def dynamic_leader(
    init_method: str,
    device_maps: dict[str, dict[int, int]],
    results: Any,
    leave: list[Any],
    joined: list[Any],
) -> None:
    """d0: hosts the store; once d1's and d2's ``init_rpc`` returned, checks the members and their
    reverse maps (the store lists a joiner before it has greeted every member), sees d1 leave."""
    fake_cuda_devices(2)
    init_rpc("d0", backend(), 0, None, options(init_method, device_maps=device_maps))
    agent = get_current_agent()
    deadline = time.monotonic() + 40
    for event in joined:
        event.wait(max(deadline - time.monotonic(), 0.0))
    report: dict[str, object] = {"joined": [i.name for i in agent.get_worker_infos()]}
    report["reverse"] = {name: rpc_sync(name, reverse_maps) for name in ("d0", "d1", "d2")}
    leave[0].set()
    while "d1" in [i.name for i in agent.get_worker_infos()] and time.monotonic() < deadline:
        time.sleep(0.05)
    report["after_leave"] = [i.name for i in agent.get_worker_infos()]
    report["call_to_left"] = _error_text(lambda: rpc_sync("d1", whoami))
    report["d2_still_serves"] = rpc_sync("d2", whoami)
    report["d2_forgot_d1"] = "d1" not in rpc_sync("d2", reverse_maps)
    leave[1].set()
    # Rank 0 hosts the store: stay until d2 has left the group.
    while len(agent.get_worker_infos()) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    shutdown(graceful=True, timeout=30.0)
    results.put(report)


def cuda_scenario_caller(init_method: str, results: Any) -> None:
    """c0: sends a CUDA tensor through a device map and one without a map; reports where they landed."""
    init_rpc("c0", backend(), 0, 2, options(init_method, device_maps={"c1": {0: 0}}))
    x = torch.ones(3, device="cuda:0")
    arrived = rpc_sync("c1", describe_device, args=(x,))
    back = rpc_sync("c1", torch.neg, args=(x,))
    no_map = _error_text(lambda: rpc_sync("c1", send_cuda_tensor_to, args=("c0",)))
    results.put((arrived, str(back.device), back.cpu().tolist(), no_map))
    shutdown(graceful=True, timeout=30.0)


def send_cuda_tensor_to(to: str) -> object:
    """Send a CUDA tensor to ``to`` (this worker has no device map for it)."""
    return rpc_sync(to, torch.neg, args=(torch.ones(1, device="cuda:0"),))


def describe_device(x: torch.Tensor) -> str:
    """The device a tensor arrived on."""
    return str(x.device)


def share_then_die(sent: Any) -> None:
    """Put two tensors in shared memory (one pooled, one in a file of its own), report, be killed."""
    from tensorpipe_backend.shm import SharedFiles
    from tensorpipe_backend.wire import tensor_bytes

    try:
        files = SharedFiles()
        pooled = files.write(tensor_bytes(torch.ones(1 << 18)))
        while files.write(tensor_bytes(torch.ones(1 << 18)))[1]:
            pass  # fill the pool until a tensor gets a file of its own
    except Exception as error:  # noqa: BLE001 - the test names it
        sent.put(f"{type(error).__name__}: {error}")
        return
    sent.put(os.getpid())
    del pooled
    time.sleep(60)


def serve_and_report(name: str, rank: int, world_size: int, init_method: str, results: Any, go: Any) -> None:
    """Join a static group, report this process's pid, wait for ``go``, shut down gracefully; report how."""
    init_rpc(name, backend(), rank, world_size, options(init_method))
    results.put(("ready", name, os.getpid(), get_current_agent().address[1]))
    go.wait(60)
    start = time.monotonic()
    outcome = _error_text(lambda: shutdown(graceful=True, timeout=30.0))
    results.put(("done", name, outcome, time.monotonic() - start))


def listening_addresses() -> tuple[tuple[str, int], bytes]:
    """This worker's TCP address and the name of its Unix socket (abstract namespace)."""
    agent = get_current_agent()
    local = agent._local_listener
    return agent.address, b"" if local is None else local.getsockname()


def _garbage() -> list[bytes]:
    """What a stranger might send to a worker's ports: pickles, noise, huge length prefixes."""
    import struct

    huge = struct.pack("!Q", 1 << 40)
    return [
        pickle.dumps(("whoami", list(range(100)))),
        os.urandom(4096),
        huge * 64,
        b"TPBA" + os.urandom(600),
        b"\xff" * 10_000,
        b"",
    ]


_kept: list[socket.socket] = []


def send_garbage(addresses: tuple[tuple[str, int], bytes], connections: int = 48, store_port: int = 0) -> int:
    """Open ``connections`` connections to a worker's TCP port and Unix socket (and to the
    rendezvous store's port, if given), send garbage on each and keep them open; how many were
    opened."""
    (host, port), local = addresses
    for i in range(connections):
        if i % 3 == 2 and store_port:
            sock = socket.create_connection(("127.0.0.1", store_port), timeout=5)
        elif i % 2 and local:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(local)
        else:
            sock = socket.create_connection((host, port), timeout=5)
        with contextlib.suppress(OSError):
            sock.sendall(_garbage()[i % 6])
        _kept.append(sock)
    return connections


def close_garbage() -> None:
    """Close the connections :func:`send_garbage` kept open."""
    for sock in _kept:
        sock.close()
    _kept.clear()


class _FloodAfterHello:
    """The socket of a member's handshake, to the server: once the hello has gone out, strangers
    from the member's own source (this host's address, or its user) open as many silent
    connections as one source may hold in the handshake, so that the member's is the one cut."""

    def __init__(self, sock: socket.socket, strangers: list[socket.socket], cut_after: list[float]) -> None:
        self._sock, self._strangers, self._cut_after = sock, strangers, cut_after

    def sendall(self, data: bytes) -> None:
        from tensorpipe_backend.peers import _MAX_HANDSHAKES_PER_SOURCE

        self._sock.sendall(data)
        if self._strangers:
            return
        agent = get_current_agent()
        peers = agent._peers
        assert peers is not None
        if self._sock.family == socket.AF_UNIX:
            where: Any = agent._local_listener.getsockname()  # type: ignore[union-attr]
        else:
            where = agent.address
        start = time.monotonic()
        for _ in range(_MAX_HANDSHAKES_PER_SOURCE):
            stranger = socket.socket(self._sock.family, socket.SOCK_STREAM)
            stranger.connect(where)
            self._strangers.append(stranger)
        while self._sock in peers._handshaking and time.monotonic() < start + 5:
            time.sleep(0.01)
        if self._sock not in peers._handshaking:
            self._cut_after.append(time.monotonic() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def serve_meeting_a_flood_in_the_first_handshake(
    init_method: str, ready: Any, done: Any, results: Any, tcp: bool
) -> None:
    """w1: serve; the first handshake after ``ready`` is set meets a flood (:class:`_FloodAfterHello`);
    reports ``("w1", [seconds until the flood cut it])``."""
    import tensorpipe_backend.peers

    if tcp:
        as_another_host()
    init_rpc("w1", backend(), 1, 3, options(init_method))
    peers_module: Any = tensorpipe_backend.peers
    real = peers_module.server_handshake
    strangers: list[socket.socket] = []
    cut_after: list[float] = []

    def meeting_a_flood(sock: socket.socket, *args: Any) -> Any:
        peers_module.server_handshake = real
        return real(_FloodAfterHello(sock, strangers, cut_after), *args)

    peers_module.server_handshake = meeting_a_flood
    ready.set()
    done.wait(60)
    for stranger in strangers:
        stranger.close()
    results.put(("w1", cut_after))
    shutdown(graceful=False)


def serve_busy_until_asked(init_method: str, ready: Any, calm: Any, done: Any, before_proof: bool) -> None:
    """w1 (liveness timeout 2 s): cut every handshake, as under a flood that never ends, after the
    proof arrived (or, with ``before_proof``, before), until ``calm`` is set; serve until ``done``."""
    import tensorpipe_backend.peers
    from tensorpipe_backend.auth import HandshakeStatus

    init_rpc("w1", backend(), 1, 3, options(init_method, liveness_timeout=2.0))
    peers_module: Any = tensorpipe_backend.peers
    real = peers_module.server_handshake

    def busy(sock: socket.socket, secret: bytes, me: Any, decide: Any, *args: Any) -> Any:
        if calm.is_set():
            return real(sock, secret, me, decide, *args)
        if before_proof:
            sock.shutdown(socket.SHUT_RD)  # as the accept loop's cut does
            return real(sock, secret, me, decide, lambda: True)
        return real(sock, secret, me, lambda peer: HandshakeStatus.BUSY, *args)

    peers_module.server_handshake = busy
    ready.set()
    done.wait(60)
    shutdown(graceful=False)


def call_a_busy_peer(init_method: str, ready: Any, calm: Any, done: Any, results: Any) -> None:
    """w2 (liveness timeout 2 s): call w1 while it cuts every handshake, then once it no longer
    does; report ``(first outcome, its seconds, second outcome)``."""
    init_rpc("w2", backend(), 2, 3, options(init_method, liveness_timeout=2.0))
    ready.wait(60)
    outcome, seconds = _timed_error(lambda: rpc_sync("w1", whoami, timeout=10))
    calm.set()
    results.put((outcome, seconds, _error_text(lambda: rpc_sync("w1", whoami, timeout=10))))
    done.set()
    shutdown(graceful=False)


def call_once_ready(init_method: str, ready: Any, done: Any, results: Any, tcp: bool) -> None:
    """w2 (of w0, w1, w2): once ``ready`` is set, make a first call to w1; report what it gave."""
    if tcp:
        as_another_host()
    init_rpc("w2", backend(), 2, 3, options(init_method))
    ready.wait(60)
    results.put(("w2", _error_text(lambda: rpc_sync("w1", whoami, timeout=20))))
    done.set()
    shutdown(graceful=False)


def garbage_then_call(
    name: str, rank: int, world_size: int, init_method: str, results: Any, done: Any, tcp: bool = False
) -> None:
    """w0: call w1, send garbage to w1's ports; w1 then makes its first call to w0, and more."""
    if tcp:
        as_another_host()
    init_rpc(name, backend(), rank, world_size, options(init_method))
    outcomes = [_error_text(lambda: rpc_sync("w1", whoami))]
    send_garbage(rpc_sync("w1", listening_addresses))
    for _ in range(10):
        outcomes.append(_error_text(lambda: rpc_sync("w1", ask_whoami, args=("w0",))))
    # w1 floods this worker's ports and the store this worker hosts.
    store_port = int(init_method.rsplit(":", 1)[1])
    outcomes.append(
        _error_text(lambda: rpc_sync("w1", send_garbage, args=(listening_addresses(), 48, store_port)))
    )
    for _ in range(10):
        outcomes.append(_error_text(lambda: rpc_sync("w1", ask_whoami, args=("w0",))))
        outcomes.append(_error_text(lambda: rpc_sync("w1", whoami)))
    outcomes.append(_error_text(lambda: rpc_sync("w1", close_garbage)))
    close_garbage()
    results.put(outcomes)
    done.set()
    shutdown(graceful=False)


class _RemovedOnFirstLook:
    """A store in which ``key`` is deleted right after this worker first looks at it, as when a
    peer takes a lost worker out of the dynamic group at that moment."""

    def __init__(self, store: Any, key: str) -> None:
        self._store, self._key, self._looked = store, key, False

    def _looked_at(self, keys: Sequence[str]) -> None:
        if self._key in keys and not self._looked:
            self._looked = True
            self._store.delete_key(self._key)

    def check(self, keys: list[str]) -> bool:
        found: bool = self._store.check(keys)
        self._looked_at(keys)
        return found

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value: bytes = self._store.compare_set(key, expected, desired)
        self._looked_at([key])
        return value

    def get(self, key: str) -> bytes:
        value: bytes = self._store.get(key)
        self._looked_at([key])
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def look_up_a_record_removed_meanwhile(init_method: str, results: Any) -> None:
    """The one worker of a dynamic group looks up ``ghost``, whose record a peer deletes from the
    store right after this worker first looks at it; reports what ``get_worker_info`` gave and how
    long it took."""
    import dataclasses

    from tensorpipe_backend.group import WorkerRecord, record_key

    init_rpc("a", backend(), 0, None, options(init_method))
    agent: Any = get_current_agent()  # its store is replaced for a moment
    store = agent._store
    mine = WorkerRecord.from_json(store.get(record_key("a")))
    store.set(record_key("ghost"), dataclasses.replace(mine, name="ghost", rank=7).to_json())
    agent._store = _RemovedOnFirstLook(store, record_key("ghost"))
    start = time.monotonic()
    outcome = _error_text(lambda: agent.get_worker_info("ghost"))
    results.put((outcome, time.monotonic() - start))
    agent._store = store
    shutdown(graceful=False)


# Lost workers: one of the group killed (SIGKILL) or frozen (SIGSTOP) by the test.
class _Warnings(logging.Handler):
    """Keeps the text of every warning the agent logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


def _agent_warnings() -> list[str]:
    """The warnings the agent will log in this process, as they come."""
    handler = _Warnings()
    logging.getLogger("tensorpipe_backend").addHandler(handler)
    return handler.texts


def _timed_error(fn: Callable[[], object]) -> tuple[str, float]:
    """What :func:`_error_text` gives for ``fn``, and how long ``fn`` took."""
    start = time.monotonic()
    text = _error_text(fn)
    return text, time.monotonic() - start


def call_whoami(to: str) -> tuple[str, float]:
    """From the callee: call ``to``; the error ("no error" if none) and how long the call took."""
    return _timed_error(lambda: rpc_sync(to, whoami))


def worker_names() -> list[str]:
    """The callee's ``get_worker_infos()``, by name."""
    return [info.name for info in get_current_agent().get_worker_infos()]


def stored_members() -> list[str]:
    """The dynamic group's member list in the store, as the callee reads it."""
    from tensorpipe_backend.group import members

    return members(get_current_agent()._store)


def _wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pending_errors(to: str, seconds: float) -> Callable[[], tuple[list[str], float]]:
    """Send ``to`` two calls (one waited for in a thread of its own, which reads its reply
    itself) that take ``seconds``; a function that waits for their errors and says how long that took."""
    futures = [rpc_async(to, sleep_then, args=(seconds, i), timeout=0) for i in range(2)]
    sync_error: list[str] = []
    waiter = threading.Thread(
        target=lambda: sync_error.append(
            _error_text(lambda: rpc_sync(to, sleep_then, args=(seconds, 9), timeout=0))
        )
    )
    waiter.start()

    def errors() -> tuple[list[str], float]:
        start = time.monotonic()
        texts = [_error_text(future.wait) for future in futures]
        waiter.join(60)
        return texts + sync_error, time.monotonic() - start

    return errors


def serve_until_told(
    name: str,
    rank: int,
    world_size: int | None,
    init_method: str,
    results: Any,
    go: Any,
    liveness_timeout: float | None = None,
) -> None:
    """Join the group (``world_size=None``: the dynamic one), report ``("ready", name)``, serve until
    ``go``, shut down gracefully; report ``("done", name, outcome, seconds, warnings)``."""
    warnings = _agent_warnings()
    extra = {} if liveness_timeout is None else {"liveness_timeout": liveness_timeout}
    init_rpc(name, backend(), rank, world_size, options(init_method, **extra))
    results.put(("ready", name))
    go.wait(120)
    outcome, seconds = _timed_error(lambda: shutdown(graceful=True, timeout=30.0))
    results.put(("done", name, outcome, seconds, warnings))


def static_survivor_k0(init_method: str, sent: Any, killed: Any, results: Any, release_k1: Any) -> None:
    """k0 (rank 0): has calls pending on k2, which the test kills; reports how they, a new call to
    k2, k1's first call to k2 and the calls between the survivors went, and the group each sees;
    then both survivors shut down."""
    warnings = _agent_warnings()
    init_rpc("k0", backend(), 0, 3, options(init_method))
    pending = _pending_errors("k2", 60.0)
    time.sleep(0.3)
    sent.put("sent")
    killed.wait(60)
    errors, waited = pending()
    report: dict[str, object] = {
        "pending": errors,
        "pending_s": waited,
        "new_call": call_whoami("k2"),
        "k1_call": rpc_sync("k1", call_whoami, args=("k2",)),
        "k0_to_k1": rpc_sync("k1", whoami),
        "k1_to_k0": rpc_sync("k1", ask_whoami, args=("k0",)),
        "k0_infos": worker_names(),
        "k1_infos": rpc_sync("k1", worker_names),
    }
    release_k1.set()
    outcome, seconds = _timed_error(lambda: shutdown(graceful=True, timeout=30.0))
    results.put(("done", "k0", outcome, seconds, warnings))
    results.put(("report", report))


def dynamic_host_d0(init_method: str, killed: Any, joined: Any, results: Any) -> None:
    """d0 (hosts the store): once d1 and d2 joined, has a call pending on d2, which the test
    kills; reports how it, a new call to d2 and d1's first one went, and the group as d0, d1 and the
    store see it; once a new worker joined under d2's name, the group again; leaves last."""
    init_rpc("d0", backend(), 0, None, options(init_method))
    _wait_for(lambda: len(worker_names()) == 3, 60)
    pending = _pending_errors("d2", 60.0)
    time.sleep(0.3)
    results.put(("sent",))
    killed.wait(60)
    errors, waited = pending()
    report: dict[str, object] = {
        "pending": errors,
        "pending_s": waited,
        "new_call": call_whoami("d2"),
        "d1_call": rpc_sync("d1", call_whoami, args=("d2",)),
        "d0_infos": worker_names(),
        "d1_infos": rpc_sync("d1", worker_names),
    }
    report["store_cleared"] = _wait_for(lambda: sorted(stored_members()) == ["d0", "d1"], 10)
    report["stored"] = stored_members()
    results.put(("report", report))
    joined.wait(120)
    after: dict[str, object] = {"d0_infos": [(i.name, i.id) for i in get_current_agent().get_worker_infos()]}
    after["d0_to_new_d2"] = rpc_sync("d2", whoami)
    results.put(("after_join", after))
    _wait_for(lambda: len(worker_names()) == 1, 120)  # d0 hosts the store: it leaves last
    outcome, seconds = _timed_error(lambda: shutdown(graceful=True, timeout=30.0))
    results.put(("done", "d0", outcome, seconds, []))


def dynamic_joiner(name: str, rank: int, init_method: str, results: Any, leave: Any) -> None:
    """Join the dynamic group; report the group it sees and what d0 and d1 answer; leave when told."""
    init_rpc(name, backend(), rank, None, options(init_method))
    results.put(("joined", worker_names(), rpc_sync("d0", whoami), rpc_sync("d1", whoami)))
    leave.wait(120)
    outcome, seconds = _timed_error(lambda: shutdown(graceful=True, timeout=30.0))
    results.put(("done", name, outcome, seconds, []))


def frozen_host_f0(init_method: str, stopped: Any, results: Any, zombie_done: Any, liveness: float) -> None:
    """f0 (hosts the store): once f1 and f2 joined, has a call pending on f2, which the test freezes;
    reports how it, a new call and f1's first call to f2 went, and the group f0 and f1 see; leaves last."""
    init_rpc("f0", backend(), 0, None, options(init_method, liveness_timeout=liveness))
    _wait_for(lambda: len(worker_names()) == 3, 60)
    pending = _pending_errors("f2", 8.0)
    time.sleep(0.3)
    results.put(("sent",))
    stopped.wait(60)
    errors, waited = pending()
    report: dict[str, object] = {
        "pending": errors,
        "pending_s": waited,
        "new_call": call_whoami("f2"),
        "f1_call": rpc_sync("f1", call_whoami, args=("f2",)),
        "f0_to_f1": rpc_sync("f1", whoami),
        "f0_infos": worker_names(),
        "f1_infos": rpc_sync("f1", worker_names),
    }
    results.put(("report", report))
    zombie_done.wait(120)
    _wait_for(lambda: len(worker_names()) == 1, 120)  # f0 hosts the store: it leaves last
    outcome, seconds = _timed_error(lambda: shutdown(graceful=True, timeout=30.0))
    results.put(("done", "f0", outcome, seconds, []))


def zombie_f2(init_method: str, results: Any, resumed: Any, liveness: float) -> None:
    """f2: joins, reports its pid; frozen by the test, then resumed: reports what two calls to f0
    give (the first may go out on the connection f0 closed, before f2 read that it did), and stops
    without leaving (its peers took it out of the group)."""
    init_rpc("f2", backend(), 2, None, options(init_method, liveness_timeout=liveness))
    results.put(("ready", "f2", os.getpid()))
    resumed.wait(120)
    time.sleep(0.5)
    results.put(("zombie", [_error_text(lambda: rpc_sync("f0", whoami)) for _ in range(2)]))
    shutdown(graceful=False)
