"""Going on without a lost rank (Join(on_rank_lost="continue")): what it costs
on healthy iterations, and how long the survivors take to go on.

- The step of our DDP under Join with on_rank_lost="continue" against
  "raise", in adjacent pairs inside the same two processes (goal <= 3 %),
  and the gloo ops it adds per healthy iteration (goal: none).
- From a rank's loss to the survivors' next completed iteration, on 3 ranks
  (an MLP, DDP + ZeRO Adam with shard replicas): killed (SIGKILL, goal <= 2 s)
  and frozen (SIGSTOP, goal <= liveness timeout + 2 s). Beside it, torchrun's
  answer: ``--max-restarts 1``, from the loss to the restarted job's first
  completed iteration (new processes, rendezvous, process group; no
  checkpoint to load, so a lower bound). And torchft's: 3 replica groups
  of one process on the same MLP, from the loss to the survivors' next
  committed step (bench/bench_torchft.py; in an environment of its own, and
  named with the reason where it cannot run).

Times across processes are CLOCK_MONOTONIC readings, which every process of
one Linux host shares.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_torchft import torchft_figures
from benchlib import Figure, cost_script_runs
from torch.profiler import ProfilerActivity, profile

from ddp_join import DistributedDataParallel, ZeroRedundancyOptimizer
from join_core import DEFAULT_LIVENESS_TIMEOUT, Join
from join_core.testing import RanksFailedError, run_ranks

_NONE = float("nan")
_LOST_AT = 5  # the iteration in which rank 2 is lost
_STEPS = 12


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "tiny":
        return torch.nn.Linear(16, 16)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def _steps(model: Any, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: int, mode: str) -> float:
    dist.barrier()
    start = time.perf_counter()
    with Join([model], on_rank_lost=mode):  # type: ignore[arg-type]
        for _ in range(steps):
            optimizer.zero_grad()
            model(data).pow(2).mean().backward()
            optimizer.step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


# One process on torch's fake backend (collectives that do nothing), in a world of one: our
# DDP's step under Join with on_rank_lost="continue" and "raise" in adjacent pairs, the steps
# timed inside the Join; what "continue" adds per step. MODEL and DATA are filled in.
_COST_SCRIPT = """
import json, statistics, time, torch, torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=1)
torch.set_num_threads(1)
from ddp_join import DistributedDataParallel
from join_core import Join
torch.manual_seed(0)
model = DistributedDataParallel(MODEL)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = DATA
def steps(n, mode):
    with Join([model], on_rank_lost=mode):
        start = time.perf_counter()
        for _ in range(n):
            optimizer.zero_grad(); model(data).pow(2).mean().backward(); optimizer.step()
        return (time.perf_counter() - start) / n
steps(10, "raise"); steps(10, "continue")
added = []
for pair in range(20):
    times = {}
    for mode in (("continue", "raise") if pair % 2 == 0 else ("raise", "continue")):
        times[mode] = steps(STEPS, mode)
    added.append(times["continue"] - times["raise"])
print(json.dumps({"added": statistics.median(added)}))
"""
_COST_MODELS = {
    "tiny": ("torch.nn.Linear(16, 16)", "torch.randn(8, 16)", 300),
    "mlp": (
        "torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), "
        "torch.nn.ReLU(), torch.nn.Linear(1024, 10))",
        "torch.randn(32, 256)",
        30,
    ),
}


def _added_per_step(name: str) -> float:
    """Seconds on_rank_lost="continue" adds to a step of ``name`` (the median of three processes)."""
    model, data, steps = _COST_MODELS[name]
    script = _COST_SCRIPT.replace("MODEL", model).replace("DATA", data).replace("STEPS", str(steps))
    return statistics.median(run["added"] for run in cost_script_runs(script, "'continue''s cost"))


def _overhead(rank: int, world_size: int, name: str, pairs: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    model = DistributedDataParallel(_model(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32 if name == "mlp" else 8, 256 if name == "mlp" else 16)
    _steps(model, optimizer, data, 10, "continue")  # warm-up
    found: dict[str, list[float]] = {"ratio": [], "step": []}
    for pair in range(pairs):
        times = {}
        for mode in ("continue", "raise") if pair % 2 == 0 else ("raise", "continue"):
            times[mode] = _steps(model, optimizer, data, steps, mode)
        found["ratio"].append(times["continue"] / times["raise"])
        found["step"].append(times["raise"])
    return found


def _gloo_ops(rank: int, world_size: int) -> dict[str, int]:
    model = DistributedDataParallel(_model("tiny"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    counts = {}
    for mode in ("raise", "continue"):
        with Join([model], on_rank_lost=mode):
            model(data).sum().backward()  # warm-up, not counted
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    optimizer.zero_grad()
                    model(data).pow(2).mean().backward()
                    optimizer.step()
        counts[mode] = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
    return counts


def _recovery(rank: int, world_size: int, how: str, out: str) -> None:
    """Rank 2 is lost in iteration _LOST_AT; each survivor writes the seconds
    from the loss to its next completed iteration to ``out``/rank<r>."""
    torch.set_num_threads(1)
    lost_at = Path(out, "lost_at")
    pids = torch.zeros(world_size, dtype=torch.int64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    model = DistributedDataParallel(_model("mlp"))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3, shard_replicas=1)
    data = torch.randn(32, 256)
    recovered = _NONE
    try:
        with Join([model, optimizer], on_rank_lost="continue") as join:
            for step in range(_STEPS):
                optimizer.zero_grad()
                loss = model(data).pow(2).mean()
                if rank == 2 and step == _LOST_AT:
                    lost_at.write_text(repr(time.monotonic()))
                    os.kill(os.getpid(), signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
                loss.backward()
                optimizer.step()
                if join.lost_ranks and recovered != recovered:
                    recovered = time.monotonic() - float(lost_at.read_text())
    finally:
        if rank != 2:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pids[2]), signal.SIGKILL)  # a frozen rank is not left behind
    Path(out, f"rank{rank}").write_text(repr(recovered))


_TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # Keys of its own per attempt: in torch 2.13 the agent's store keeps the last attempt's.
    store = dist.PrefixStore(f"attempt{{attempt}}/", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False))
    dist.init_process_group(
        "gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, restarted = dist.get_rank(), attempt > 0
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.randn(32, 256)
    for step in range({steps}):
        optimizer.zero_grad()
        loss = model(data).pow(2).mean()
        if not restarted and rank == 2 and step == {lost_at}:
            with open(os.path.join(out, "lost_at"), "w") as f:
                f.write(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        if restarted and rank == 0 and step == 0:
            with open(os.path.join(out, "first_step"), "w") as f:
                f.write(repr(time.monotonic()))
    dist.destroy_process_group()
    """
)


def _torchrun_restart() -> float:
    """Seconds from a worker's SIGKILL to the first completed iteration of
    the job torchrun --max-restarts 1 starts again."""
    with tempfile.TemporaryDirectory() as out:
        script = Path(out) / "train.py"
        script.write_text(_TORCHRUN_SCRIPT.format(steps=_STEPS, lost_at=_LOST_AT))
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--max-restarts", "1",
            "--standalone", "--monitor-interval", "0.1",
            str(script), out,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="WARNING")
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not (Path(out) / "first_step").exists():
            print(f"torchrun --max-restarts 1 failed ({done.returncode}):\n{done.stderr[:6000]}")
            return _NONE
        lost = float((Path(out) / "lost_at").read_text())
        return float((Path(out) / "first_step").read_text()) - lost


def continue_figures(rounds: int, quick: bool) -> list[Figure]:
    """The cost of on_rank_lost="continue" on healthy steps, and the time to go on after a loss."""
    pairs = max(rounds * 2, 6 if quick else 20)
    figures = []
    for name, label, steps in (
        ("tiny", "Linear(16,16) batch 8", 100),
        ("mlp", "MLP 256-1024-1024-10 batch 32", 30),
    ):
        found: Any = run_ranks(_overhead, 2, name, pairs, steps // 2 if quick else steps, timeout=900)[0]
        timed = statistics.median(found["ratio"]) - 1
        step = statistics.median(found["step"])
        added = _added_per_step(name)
        overhead = added / step
        print(
            f"on_rank_lost='continue', {label} step of {step * 1e3:.2f} ms: {added * 1e6:.0f} us added "
            f"({overhead * 100:+.2f} %); timed {timed * 100:+.2f} %"
        )
        figures += [
            Figure(
                f"on_rank_lost='continue' overhead per healthy step, DDP {label}: time it adds to a step "
                "(one process, fake backend) / step time",
                "% of the step",
                overhead * 100,
                _NONE,
                "<= 3%",
                overhead * 100,
                overhead <= 0.03,
                f"{added * 1e6:.0f} us added",
            ),
            Figure(
                f"  the same timed, 2 ranks, {pairs} pairs (Join's entry and exit included)",
                "% over 'raise'",
                timed * 100,
                _NONE,
                "(context)",
                _NONE,
                True,
            ),
        ]
    counts = run_ranks(_gloo_ops, 2, timeout=300)[0]
    extra = (counts["continue"] - counts["raise"]) / 5
    figures.append(
        Figure(
            "extra collectives per healthy iteration with on_rank_lost='continue'",
            "gloo ops",
            extra,
            _NONE,
            "0 extra",
            extra,
            extra <= 0,
        )
    )
    restart = _torchrun_restart()
    liveness = DEFAULT_LIVENESS_TIMEOUT.total_seconds()
    for how, goal in (("kill", 2.0), ("freeze", liveness + 2.0)):
        seconds = _loss_to_next_iteration(how, 1 if quick else 3)
        print(
            f"rank killed ({how}): survivors' next iteration {seconds:.2f} s after; torchrun {restart:.2f} s"
        )
        figures.append(
            Figure(
                f"loss of 1 of 3 ranks ({'SIGKILL' if how == 'kill' else 'SIGSTOP'}) to the survivors' next "
                "iteration, MLP, DDP + ZeRO Adam",
                "s",
                seconds,
                restart,
                f"<= {goal:g} s",
                seconds,
                seconds <= goal,
                reference="torchrun --max-restarts 1, to the restarted job's first iteration",
            )
        )
        if how == "kill":
            figures += torchft_figures(seconds, 1 if quick else 3)
    return figures


def _loss_to_next_iteration(how: str, runs: int) -> float:
    """Median over ``runs`` of the survivors' slowest recovery (run_ranks gives no
    result when a rank is lost, so each survivor writes its time to a file)."""
    times = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as out:
            try:
                run_ranks(_recovery, 3, how, out, timeout=120)
            except RanksFailedError as failed:
                if sorted(failed.failures) != [2]:
                    raise
            times.append(max(float(Path(out, f"rank{rank}").read_text()) for rank in (0, 1)))
    return statistics.median(times)
