"""torchft's answer to a lost replica, run inside .venvs/peer-torchft (bench/bench_torchft.py).

    python bench/bench_torchft_replicas.py --out DIR [--join-timeout-ms MS]

Starts a ``torchft_lighthouse`` on 127.0.0.1 (an OS-picked port) as torchft's
README runs it (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms
10000``; ``--join-timeout-ms`` changes the last), and 3 replica groups of one
process each. Each trains the MLP 256-1024-1024-10 on a batch of 32 with
torchft's ``Manager`` (its defaults: ProcessGroupGloo, async quorum, init sync,
60 s timeouts) and ``Optimizer`` over Adam; gradients go through
``manager.allreduce`` in one flat bucket after backward, as a DDP bucket would.

torchft 0.2.0's own ``DistributedDataParallel`` cannot be used: when the
all-reduce fails (a peer is gone), its comm hook asserts on the future that
``Manager.allreduce`` left unset, and the survivors die with an AssertionError
instead of going on.

Replica 2 kills itself (SIGKILL) after the forward of iteration 5 (or the
first iteration after it in which all 3 replicas are in the quorum). Each
survivor writes the CLOCK_MONOTONIC seconds from that kill to its first
committed step after it; the slowest of the two goes to DIR/result.json, with
the quorum sizes before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

_REPLICAS: Final = 3
_VICTIM: Final = 2
_LOST_AT: Final = 5
_DEADLINE_S: Final = 120.0  # for the whole run: start-up, the loss, the recovery
_LISTENING: Final = re.compile(r"Lighthouse listening on: \S+:(\d+)")


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL when this driver dies, so that nothing outlives it."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def _replica(replica: int, lighthouse: str, out: Path) -> int:
    """One replica group of one process: train until the first committed step after the loss."""
    import torch
    from torch._C._distributed_c10d import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    deadline = time.monotonic() + _DEADLINE_S
    # The replica group's own store, as torchrun's agent would serve it.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = _model()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        adam.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": adam.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"bench_{replica}",
        hostname="127.0.0.1",
    )
    optimizer = Optimizer(manager, adam)
    params = list(model.parameters())
    data = torch.randn(32, 256)
    # Every manager heartbeats before the first quorum: the lighthouse then waits for all 3.
    (out / f"ready{replica}").touch()
    while len(list(out.glob("ready*"))) < _REPLICAS:
        if time.monotonic() > deadline:
            print(f"replica {replica}: the other replicas were not ready within {_DEADLINE_S:.0f} s")
            return 1
        time.sleep(0.01)
    lost = out / "lost.json"
    iteration = 0
    while time.monotonic() < deadline:
        optimizer.zero_grad()  # starts the quorum of this step
        loss = model(data).pow(2).mean()
        if replica == _VICTIM and iteration >= _LOST_AT and manager.num_participants() == _REPLICAS:
            step = manager.current_step()
            lost.write_text(json.dumps({"at": time.monotonic(), "step": step, "participants": _REPLICAS}))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()  # on a failure: reported to the manager, the step not committed
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        optimizer.step()  # commits only if the quorum agrees
        done_at = time.monotonic()
        iteration += 1
        if replica != _VICTIM and lost.exists():
            killed = json.loads(lost.read_text())
            if manager.current_step() > killed["step"]:  # committed the step the loss broke
                result = {"seconds": done_at - killed["at"], "participants": manager.num_participants()}
                (out / f"survivor{replica}.json").write_text(json.dumps(result))
                manager.shutdown(wait=False)
                return 0
    print(f"replica {replica}: no committed step after the loss within {_DEADLINE_S:.0f} s")
    return 1


def _lighthouse_port(log: Path, proc: subprocess.Popen[bytes], deadline: float) -> int:
    """The port the lighthouse says it listens on (its log line), waiting until ``deadline``."""
    while time.monotonic() < deadline:
        found = _LISTENING.search(log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"torchft_lighthouse did not say where it listens within {_DEADLINE_S:.0f} s")


def _drive(out: Path, join_timeout_ms: int) -> int:
    """Lighthouse, 3 replicas, the loss; write out/result.json."""
    deadline = time.monotonic() + _DEADLINE_S
    lighthouse_bin = Path(sys.executable).parent / "torchft_lighthouse"
    command = [
        str(lighthouse_bin), "--bind", "127.0.0.1:0", "--min_replicas", "1",
        "--quorum_tick_ms", "100", "--join_timeout_ms", str(join_timeout_ms),
    ]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    with open(out / "lighthouse.log", "wb") as lighthouse_log:
        try:
            procs.append(subprocess.Popen(command, stderr=lighthouse_log, preexec_fn=_die_with_parent))
            port = _lighthouse_port(out / "lighthouse.log", procs[0], deadline)
            # gloo's pairs on the loopback too, whatever the host name resolves to.
            env = dict(os.environ)
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            for replica in range(_REPLICAS):
                args = [sys.executable, __file__, "--out", str(out), "--replica", str(replica)]
                args += ["--lighthouse", f"http://127.0.0.1:{port}"]
                procs.append(subprocess.Popen(args, env=env, preexec_fn=_die_with_parent))
            replicas = procs[1:]
            for proc in replicas:
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            print(f"the replicas did not finish within {_DEADLINE_S:.0f} s")
            return 1
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)
    codes = [proc.returncode for proc in replicas]
    expected = [0 if r != _VICTIM else -signal.SIGKILL for r in range(_REPLICAS)]
    if codes != expected:
        print(f"replicas exited {codes}, expected {expected}")
        return 1
    killed = json.loads((out / "lost.json").read_text())
    survivors = [
        json.loads((out / f"survivor{r}.json").read_text()) for r in range(_REPLICAS) if r != _VICTIM
    ]
    result = {
        "seconds": max(s["seconds"] for s in survivors),
        "participants_before": killed["participants"],
        "participants_after": min(s["participants"] for s in survivors),
    }
    (out / "result.json").write_text(json.dumps(result))
    return 0


def main(argv: list[str]) -> int:
    """The driver, or (with --replica) one replica group."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a folder for the results and the logs")
    parser.add_argument(
        "--join-timeout-ms", type=int, default=10000, help="the lighthouse's --join_timeout_ms"
    )
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica is not None:
        return _replica(args.replica, args.lighthouse, args.out)
    return _drive(args.out, args.join_timeout_ms)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
