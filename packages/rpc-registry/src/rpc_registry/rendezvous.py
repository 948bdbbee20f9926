"""The rendezvous of ``init_rpc``: the store every worker of a group meets in, within a time limit.

``tcp://`` and ``env://`` URLs get a ``TCPStore`` made here, hosted by rank 0,
that does not block its host until every worker connected; instead every
worker of a static group marks its arrival and waits for the others'. As
torch's ``init_rpc``, the wait lasts up to the rendezvous timeout (torch's
30 minutes, or the options' ``rendezvous_timeout``), not ``rpc_timeout``,
which is the limit of one call: a worker that starts late is waited for.
The wait is not silent: every few seconds a warning names the ranks still
missing, and a worker that never comes is named at the end (``rank 2 never
arrived``). Other URLs (``file://``) go through
``torch.distributed.rendezvous`` with the same limit. Successive starts of
a static group on one store use separate keys; a dynamic group is one
session for as long as its store lives.

Rank 0 hands the store a listening socket of its own, on the URL's IPv4
address only. torch's store would listen on every interface, IPv6
included, so a peer on 127.0.0.1 arrives as ``::ffff:127.0.0.1``; the
store names each connection it accepts with a reverse lookup that
``/etc/hosts`` cannot answer for that form, and one lost DNS reply stalls
its accept loop, and every worker behind it, for the resolver's 5 s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Final
from urllib.parse import parse_qs, urlparse

from torch._C._distributed_c10d import TCPStore
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.distributed.rendezvous import rendezvous

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RENDEZVOUS_TIMEOUT_S", "rendezvous_store"]

#: How long ``init_rpc`` waits for the group by default: torch's (its process groups' default).
DEFAULT_RENDEZVOUS_TIMEOUT_S: Final = 1800.0
#: The store's limit for one operation when ``rpc_timeout`` is 0 (no limit on calls).
UNLIMITED_INIT_S: Final = DEFAULT_RENDEZVOUS_TIMEOUT_S
#: While waiting for the group: a warning naming who is missing, this often.
PROGRESS_S: Final = 5.0
# Waiting for the rendezvous store to listen: one probe every few ms at first,
# then every _STORE_SLOW_POLL_S once it has been missing for _STORE_FAST_S.
_STORE_POLL_S: Final = 0.002
_STORE_FAST_S: Final = 1.0
_STORE_SLOW_POLL_S: Final = 0.05
_STORE_PROBE_S: Final = 0.1


def _await_store(host: str, port: int, timeout: float, rank: int = -1) -> bool:
    """Wait until the store's address accepts connections, polling every few milliseconds
    (torch's store client, started too early, backs off for up to a second); whether it
    did within ``timeout``. Warns every :data:`PROGRESS_S` seconds."""
    start = time.monotonic()
    next_note = start + PROGRESS_S
    while True:
        try:
            socket.create_connection((host, port), timeout=_STORE_PROBE_S).close()
            return True
        except OSError:
            now = time.monotonic()
            waited = now - start
            if waited >= timeout:
                return False
            if now >= next_note:
                next_note = now + PROGRESS_S
                logger.warning(
                    "init_rpc(rank=%d): waiting for rank 0's rendezvous store at %s:%d to listen "
                    "(%.0f s of at most %g s)",
                    rank,
                    host,
                    port,
                    waited,
                    timeout,
                )
            time.sleep(min(_STORE_POLL_S if waited < _STORE_FAST_S else _STORE_SLOW_POLL_S, timeout - waited))


def _address(url: str) -> tuple[str, int] | None:
    """Host and port of the store for ``tcp://`` and ``env://`` (None: another scheme, or
    a torchelastic agent's store, which torch's rendezvous knows how to reach)."""
    parsed = urlparse(url)
    if parsed.scheme == "tcp":
        if parsed.hostname is None or parsed.port is None:
            raise ValueError(
                f"init_method={url!r}: a tcp:// URL needs a host and a port, e.g. tcp://10.0.0.1:29500"
            )
        return parsed.hostname, parsed.port
    if parsed.scheme == "env" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if not host or not port.isdigit():
            raise ValueError(
                f"init_method={url!r}: env:// reads MASTER_ADDR and MASTER_PORT, and they are "
                f"{host!r} and {port!r}; set both (e.g. MASTER_ADDR=127.0.0.1 MASTER_PORT=29500)"
            )
        return host, int(port)
    return None


def _ipv4_listener(host: str, port: int) -> socket.socket | None:
    """A listening socket on ``host``'s IPv4 address and ``port``; ``None`` when ``host`` has no
    IPv4 address of this machine or the port is taken (torch's store then says why, or reuses
    its own server of that port in this process)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[
            0
        ]
    except (OSError, IndexError):
        return None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        return None
    return listener


def _tcp_store(host: str, port: int, world_size: int | None, is_master: bool, limit: timedelta) -> Store:
    """The ``TCPStore`` at ``host:port``; rank 0 hosts it on an IPv4 listener of its own (see the
    module docstring) where it can."""
    listener = _ipv4_listener(host, port) if is_master else None
    if listener is not None:
        with listener:
            fd = os.dup(listener.fileno())  # the store owns and closes this one
        try:
            return TCPStore(
                host,
                port,
                world_size,
                True,
                limit,
                wait_for_workers=False,
                multi_tenant=True,
                master_listen_fd=fd,
            )
        except TypeError as exc:  # a torch without master_listen_fd: the descriptor was not taken
            os.close(fd)
            logger.debug("the store cannot take a listener (%s); it listens itself", exc)
    return TCPStore(host, port, world_size, is_master, limit, wait_for_workers=False, multi_tenant=True)


def _client_store(host: str, port: int, world_size: int | None, limit: timedelta, deadline: float) -> Store:
    """The store client of a rank other than 0, given up on at ``deadline``.

    torch's client waits without limit for the answer of whatever listens at
    the address; when that is another program (a busy ``MASTER_PORT``), it
    would wait forever. So it is made on a helper thread (torch releases the
    GIL meanwhile), left behind if it never returns.
    """
    made: list[Store] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            made.append(_tcp_store(host, port, world_size, False, limit))
        except BaseException as exc:  # noqa: BLE001 - raised again in the calling thread
            failed.append(exc)

    left = max(deadline - time.monotonic(), 0.001)
    limit = min(limit, timedelta(seconds=left))  # torch's own connect gives up by the deadline too
    thread = threading.Thread(target=make, name=f"rpc_registry store client {host}:{port}", daemon=True)
    thread.start()
    thread.join(left)
    if failed:
        raise failed[0]
    if not made:
        raise RuntimeError(
            f"port {port} accepts connections but no rendezvous store answered there: another "
            "program may be listening on it; give every worker the same free port "
            "(MASTER_PORT, or the port of the tcp:// init_method)"
        )
    return made[0]


def _answer_deadline(deadline: float, rpc_timeout: float) -> float:
    """When a store found listening must have answered: one store operation's limit
    (``rpc_timeout``; ``0``: none), within the rendezvous ``deadline``."""
    return deadline if rpc_timeout <= 0 else min(deadline, time.monotonic() + rpc_timeout)


def _rank_and_size(url: str, rank: int, world_size: int | None) -> tuple[int, int | None]:
    """The rank and world size, completed from the URL's query or (``env://``) the environment."""
    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    if rank == -1:
        text = query.get("rank", os.environ.get("RANK", "") if parsed.scheme == "env" else "")
        if text.lstrip("-").isdigit():
            rank = int(text)
    if world_size is None and parsed.scheme == "env" and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    if rank < 0:
        raise _rank_missing(url, rank, world_size)
    if world_size is not None and rank >= world_size:
        raise ValueError(
            f"rank={rank}: must be below world_size={world_size} (as init_rpc's arguments, the URL "
            f"{url!r} or RANK and WORLD_SIZE for env:// give them); give each worker a rank from 0 to "
            "world_size - 1"
        )
    return rank, world_size


def _rank_missing(url: str, rank: int, world_size: int | None) -> ValueError:
    # torch's phrases first, which callers may match.
    what = "environment variable RANK expected" if url.startswith("env:") else "rank parameter missing"
    group = "a dynamic group (world_size=None) needs" if world_size is None else "init_rpc needs"
    return ValueError(f"{what}: rank={rank}: {group} this worker's rank; pass rank= (or set RANK for env://)")


def rendezvous_store(
    url: str,
    rank: int,
    world_size: int | None,
    rpc_timeout: float,
    timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
) -> tuple[Store, int, int | None]:
    """Meet the group at ``url``; the session's store, this worker's rank and the world size.

    ``world_size=None`` joins a dynamic group (no arrival check). Waits for the
    store and the other workers at most ``timeout`` seconds, warning every
    :data:`PROGRESS_S` seconds which ranks it waits for; the store's own
    operations are limited by ``rpc_timeout`` afterwards (``0``:
    :data:`UNLIMITED_INIT_S`).

    Raises:
        TimeoutError: naming the ranks that did not arrive in time.
        ValueError: the URL or environment does not say where the store is.
    """
    limit = timedelta(seconds=timeout)
    if url.startswith("env:"):
        rank, world_size = _rank_and_size(url, rank, world_size)  # RANK before MASTER_ADDR, as torch
    address = _address(url)
    started = time.monotonic()
    if address is not None:
        rank, world_size = _rank_and_size(url, rank, world_size)
        host, port = address
        try:
            if rank != 0 and not _await_store(host, port, timeout, rank):
                raise RuntimeError(
                    "nothing accepted a connection there; start rank 0, which hosts it, with the "
                    "same address and port"
                )
            left = timedelta(seconds=max(started + timeout - time.monotonic(), _STORE_PROBE_S))
            store: Store = (
                _tcp_store(host, port, world_size, True, left)
                if rank == 0
                else _client_store(
                    host, port, world_size, left, _answer_deadline(started + timeout, rpc_timeout)
                )
            )
        except (RuntimeError, OSError) as exc:
            waited = time.monotonic() - started
            role = "host" if rank == 0 else "reach"
            raise TimeoutError(
                f"init_rpc(rank={rank}): could not {role} the rendezvous store at {host}:{port} "
                f"(after {waited:.1f} s of at most {timeout:g} s): {exc}"
            ) from exc
    else:
        if rank < 0 and "rank" not in parse_qs(urlparse(url).query):
            raise _rank_missing(url, rank, world_size)
        if world_size is None:
            # torch's rendezvous adds no world_size of -1 itself: both go in the URL.
            separator = "&" if "?" in url else "?"
            store, rank, _ = next(rendezvous(f"{url}{separator}rank={rank}&world_size=-1", timeout=limit))
        else:
            store, rank, world_size = next(rendezvous(url, rank=rank, world_size=world_size, timeout=limit))
    store.set_timeout(timedelta(seconds=rpc_timeout if rpc_timeout > 0 else UNLIMITED_INIT_S))
    prefixed = PrefixStore(f"rpc_session_{_session(store, rank, world_size)}", store)
    if world_size is not None:
        _await_arrivals(prefixed, rank, world_size, started + timeout, started, url)
    return prefixed, rank, world_size


def _session(store: Store, rank: int, world_size: int | None) -> str:
    """The name of the keys of this worker's session in ``store``.

    Each rank counts its own starts in the store itself, so that the workers
    of a static group that all start again agree, and a fresh store (a fresh
    group) starts from 1 whatever a process did before. A dynamic group is
    one session for as long as its store lives, the one its first member
    counted: a worker that joins it (a new process, one that takes a departed
    worker's rank, or one that left and comes back) meets its members there,
    and one that comes to the session of a static group is told it cannot
    join it. When torchrun starts every worker again, they start a new one.
    """
    counted = str(store.add(f"rpc_registry/sessions/rank{rank}", 1))
    if world_size is not None:
        return counted
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    first: bytes = store.compare_set(f"rpc_registry/sessions/dynamic/{restart}", "", counted)
    return first.decode()


def _await_arrivals(
    store: Store, rank: int, world_size: int, deadline: float, started: float, url: str
) -> None:
    keys = [f"rpc_registry/arrived/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(min(left, PROGRESS_S), 0.001)))
            return
        except RuntimeError:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing:
                raise
            ranks = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            waited = time.monotonic() - started
            if time.monotonic() < deadline:
                logger.warning(
                    "init_rpc(rank=%d): waiting for %s to reach the rendezvous at %s (%.0f s of at most %g s)",
                    rank,
                    ranks,
                    url,
                    waited,
                    deadline - started,
                )
                continue
            raise TimeoutError(
                f"init_rpc(rank={rank}): waited {waited:.1f} s for all {world_size} workers to reach the "
                f"rendezvous at {url}; {ranks} never arrived. Start every worker with the same "
                "init_method and world_size, or raise the options' rendezvous_timeout "
                f"(now {deadline - started:g} s)"
            ) from None  # the store's "wait timeout" adds nothing, and would be printed first
