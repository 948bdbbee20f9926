"""Losing a rank and going on across two hosts: two network namespaces joined
by a veth pair (root only), an agent of ``python -m join_core.launch`` in
each, 2 workers each; the last rank is killed mid-epoch and the three others,
on both hosts, finish it exactly."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from training_common import reference_dense

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))

from bench_hosts import two_hosts  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None,
        reason="two hosts need network namespaces: root and iproute2",
    ),
    pytest.mark.timeout(240),
]

PORT = 29431  # the rendezvous port on host a: a fresh namespace has nothing else listening
Host = tuple[str, str, str]  # namespace, interface, address


def _agents(a: Host, b: Host, args: list[str]) -> list[subprocess.Popen[str]]:
    """An agent of python -m join_core.launch in each namespace, 2 workers each, host a serving the
    rendezvous; each in a session of its own, so that everything under it can be killed."""
    agents = []
    for namespace, interface, address in (a, b):
        command = [
            "ip", "netns", "exec", namespace, sys.executable, "-m", "join_core.launch",
            "--nnodes", "2", "--nproc-per-node", "2", "--local-addr", address, "--agent-timeout", "10",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a[2]}:{PORT}", "--rdzv-id", "survivors",
            "--rdzv-conf", f"is_host={int(namespace == a[0])}",  # a namespace's address is not the hostname's
            str(HERE / "train_survivors.py"), *args,
        ]  # fmt: skip
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, OMP_NUM_THREADS="1")
        agents.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return agents


def _stop(agents: list[subprocess.Popen[str]], marker: Path) -> None:
    """Kill the agents' sessions, then any of their workers still running (torch's launcher starts
    them in sessions of their own; ours has them end with their agent, and this makes sure): every
    process whose command line names ``marker``, the test's own folder."""
    for agent in agents:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()
    needle = str(marker).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)


def _check(result_dir: Path, survivors: list[int], lost: dict[int, int]) -> None:
    """The survivors hold one model, equal to one process over the batches each rank trained on."""
    results = {}
    for rank in survivors:
        with open(result_dir / f"rank{rank}.pkl", "rb") as f:
            results[rank] = pickle.load(f)
    first = results[survivors[0]]
    assert {rank: len(batches) for rank, batches in first["lost"].items()} == lost, first["lost"]
    trained = [results[rank]["batches"] if rank in results else first["lost"][rank] for rank in range(4)]
    assert sorted(b for batches in trained for b in batches) == list(range(30))
    for rank in survivors[1:]:
        assert torch.equal(results[rank]["params"], first["params"])
    expected = reference_dense(trained, lambda ps: torch.optim.Adam(ps, lr=0.02))
    torch.testing.assert_close(first["params"], expected, rtol=1e-5, atol=1e-6)


def test_survivors_on_both_hosts_finish_the_epoch_exactly(tmp_path: Path) -> None:
    with two_hosts() as (a, b):
        agents = _agents(a, b, ["--lose-rank", "3@4", "--result-dir", str(tmp_path)])
        try:
            outputs = [agent.communicate(timeout=180)[0] for agent in agents]
        finally:
            _stop(agents, tmp_path)
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output
    _check(tmp_path, [0, 1, 2], {3: 4})


@pytest.mark.slow(
    reason="two hosts' agents and four ranks each import torch; the survivors then wait out the liveness timeout of the host cut off (about 40 s)"
)
def test_the_survivors_of_a_host_cut_off_finish_the_epoch_exactly(tmp_path: Path) -> None:
    mark = tmp_path / "training"
    args = ["--result-dir", str(tmp_path), "--step-seconds", "0.3", "--mark", str(mark)]
    with two_hosts() as (a, b):
        agents = _agents(a, b, args)
        try:
            deadline = time.monotonic() + 120
            while not mark.exists():
                assert time.monotonic() < deadline and agents[0].poll() is None, "training did not start"
                time.sleep(0.1)
            subprocess.run(["ip", "-n", b[0], "link", "set", b[1], "down"], check=True)  # host b is cut off
            output = agents[0].communicate(timeout=120)[0]
        finally:
            _stop(agents, tmp_path)
    assert agents[0].returncode == 0, output
    with open(tmp_path / "rank0.pkl", "rb") as f:
        lost = {rank: len(batches) for rank, batches in pickle.load(f)["lost"].items()}
    assert sorted(lost) == [2, 3], output  # host b's workers
    _check(tmp_path, [0, 1], lost)
