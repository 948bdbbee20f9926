"""A static group's barriers run over the agent's own authenticated connections."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from tpb_workers import CONTEXT, free_port, serve_and_report, spawned

from tensorpipe_backend.rounds import GroupRounds, RoundFailedError

pytestmark = pytest.mark.timeout(120)


def _listening_ports(pid: int) -> set[int]:
    """TCP ports on which process ``pid`` listens (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _spray(port: int) -> None:
    """Random bytes, as a stranger on the network would send, on a few connections."""
    for size in (1, 64, 4096, 65536):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.sendall(os.urandom(size))
        except OSError:
            pass


def _start(world_size: int) -> tuple[str, list[tuple[Callable[..., None], tuple[Any, ...]]], Any, Any, int]:
    store_port = free_port()
    init_method = f"tcp://127.0.0.1:{store_port}"
    results, go = CONTEXT.Queue(), CONTEXT.Event()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (serve_and_report, (f"r{rank}", rank, world_size, init_method, results, go))
        for rank in range(world_size)
    ]
    return init_method, targets, results, go, store_port


def test_a_worker_listens_on_no_tcp_port_but_its_authenticated_one() -> None:
    _, targets, results, go, store_port = _start(3)
    with spawned(targets, timeout=60) as workers:
        ready = [results.get(timeout=60) for _ in range(3)]
        try:
            for _, name, pid, agent_port in ready:
                extra = _listening_ports(pid) - {agent_port, store_port}
                assert not extra, f"{name} listens on {sorted(extra)} beside its agent's port {agent_port}"
        finally:
            go.set()
        outcomes = {name: outcome for _, name, outcome, _ in (results.get(timeout=60) for _ in range(3))}
    assert outcomes == {"r0": "no error", "r1": "no error", "r2": "no error"}
    assert [w.exitcode for w in workers] == [0, 0, 0]


def test_random_bytes_on_every_listening_port_do_not_break_graceful_shutdown() -> None:
    _, targets, results, go, store_port = _start(3)
    with spawned(targets, timeout=60) as workers:
        pids = {name: pid for _, name, pid, _ in (results.get(timeout=60) for _ in range(3))}
        ports = set().union(*(_listening_ports(pid) for pid in pids.values())) - {store_port}
        assert ports, "the workers listen on no TCP port"
        for port in ports:
            _spray(port)
        go.set()
        outcomes = {name: outcome for _, name, outcome, _ in (results.get(timeout=60) for _ in range(3))}
    assert outcomes == {"r0": "no error", "r1": "no error", "r2": "no error"}
    assert [w.exitcode for w in workers] == [0, 0, 0]


def test_a_worker_killed_during_shutdown_is_left_out_and_the_others_finish_it() -> None:
    _, targets, results, go, _ = _start(3)
    never = CONTEXT.Event()  # r2 waits on its own event: killing a waiter breaks an event for the others
    targets[2] = (serve_and_report, (*targets[2][1][:5], never))
    with spawned(targets, timeout=60) as workers:
        pids = {name: pid for _, name, pid, _ in (results.get(timeout=60) for _ in range(3))}
        go.set()
        time.sleep(1.0)  # r0 and r1 wait for r2 in the shutdown barrier
        workers[2].kill()
        reports = [results.get(timeout=60) for _ in range(2)]
    assert pids
    for _, name, outcome, elapsed in reports:
        assert outcome == "no error", (name, outcome)
        assert elapsed < 10.0, (name, elapsed)


def _in_process_group(world_size: int) -> list[GroupRounds]:
    """The rounds of ``world_size`` workers of this process, whose frames go straight to each other."""
    names = [f"r{rank}" for rank in range(world_size)]
    groups: list[GroupRounds] = []

    def sender(rank: int) -> Callable[[str, int, bytes], None]:
        return lambda to, number, payload: groups[names.index(to)].deliver(rank, number, payload)

    groups.extend(GroupRounds(rank, names, sender(rank)) for rank in range(world_size))
    return groups


def test_a_round_waiting_for_a_lost_worker_fails_at_once_naming_it_and_the_time_waited() -> None:
    r0, _, _ = _in_process_group(3)
    threading.Timer(0.3, r0.lost, args=(2, "it sent nothing for 2.0 s")).start()
    start = time.monotonic()
    with pytest.raises(RoundFailedError, match=r"worker r2 \(rank 2\) was lost after 0\.[3-9] s of sync\(\)"):
        r0.barrier(30.0, "sync()")
    assert time.monotonic() - start < 5.0


def test_a_sum_that_skips_the_lost_goes_on_without_them() -> None:
    r0, r1, _ = _in_process_group(3)
    r0.lost(2, "its process ended")
    r1_sum: list[int] = []
    thread = threading.Thread(target=lambda: r1_sum.append(r1.sum(5, 30.0, "a count", skip_lost=True)))
    thread.start()
    assert r0.sum(2, 30.0, "a count", skip_lost=True) == 7
    thread.join(10)
    assert r1_sum == [7]
