"""Demo: a data-parallel training run with uneven inputs on local processes.

Rank 0 hosts a data coordinator that hands out batches by RPC, each rank with
its own quota, so ranks run out at different times. Every rank trains
ddp_join.DistributedDataParallel + ZeroRedundancyOptimizer under
join_core.Join([model, optimizer]); ranks that run out join and shadow the
others. At the end every rank must hold the same model, equal to a
single-process run over the same batches.

With --fsdp every rank instead trains a model sharded with FSDP2's
fully_shard under Join([FSDPJoinable(model, optimizer)]), each with its own
number of batches, then evaluates it exactly on a set split by
UnevenDistributedSampler.

With --lose-rank R@K, rank R is killed (SIGKILL) in iteration K of a run
under Join(on_rank_lost="continue") (DDP + ZeRO with shard replicas, batches
from UnevenDistributedSampler), launched with python -m join_core.launch: the
survivors take its later batches over and go on, and must end with the same
model, equal to a single-process run over the batches each rank trained on.

    python3 tools/dev.py demo [--nproc N] [--device cpu|cuda] [--backend gloo|nccl] [--fsdp]
    python3 tools/dev.py demo --nproc 3 --lose-rank 1@5
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import pickle
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "integration_tests"))

from launch import launch  # noqa: E402
from training_common import read_results, reference_dense  # noqa: E402

from join_core.testing import run_launch  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="number of local ranks (default 2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--base", type=int, default=12, help="batches of rank 0 (default 12)")
    parser.add_argument("--extra", type=int, default=6, help="batches each next rank has more (default 6)")
    parser.add_argument(
        "--fsdp", action="store_true", help="train an FSDP2 model, then evaluate it exactly (no coordinator)"
    )
    parser.add_argument(
        "--lose-rank",
        metavar="R@K",
        default=None,
        help="kill rank R in iteration K; the survivors go on (Join(on_rank_lost='continue'))",
    )
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: need at least one rank")
    if args.lose_rank is not None:
        lost = _lost_rank(parser, args.lose_rank, args.nproc, args.fsdp)
        problem = device_problem(args.device, args.backend, args.nproc)
        if problem is not None:
            parser.exit(2, f"demo: {problem}\n")
        return lose_rank_demo(Console(), args.nproc, args.device, args.backend, lost, args.lose_rank)
    problem = device_problem(args.device, args.backend, args.nproc)
    if problem is not None:  # one sentence now rather than a traceback from every rank later
        parser.exit(2, f"demo: {problem}\n")

    console = Console()
    console.print(
        f"[bold]{args.nproc} ranks[/] on {args.device} over {args.backend}; rank r gets "
        f"{args.base} + {args.extra}*r batches "
        + ("(FSDP2 under Join, then an exact evaluation)" if args.fsdp else "from the coordinator on worker0")
    )
    joined: list[int] = []
    with Progress(
        TextColumn("rank {task.fields[rank]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        tasks = {r: progress.add_task("", total=None, rank=r, loss="-") for r in range(args.nproc)}

        def on_line(rank: int, line: str) -> None:
            try:
                event: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                progress.console.print(f"[dim]rank {rank}:[/] {line.rstrip()}")
                return
            if "batch" in event:
                progress.update(
                    tasks[rank],
                    completed=event["batch"],
                    total=event["batch"] + event["left"],
                    loss=f"{event['loss']:.4f}",
                )
            elif "joined" in event:
                joined.append(rank)
                progress.console.print(
                    f"rank {rank} ran out of inputs after {event['joined']} batches: joined "
                    f"({len(joined)} of {args.nproc})"
                )

        with tempfile.TemporaryDirectory() as result_dir:
            exits = launch(
                ROOT / "integration_tests" / ("train_fsdp.py" if args.fsdp else "train_coordinated.py"),
                args.nproc,
                [
                    "--device",
                    args.device,
                    "--backend",
                    args.backend,
                    "--base",
                    str(args.base),
                    "--extra",
                    str(args.extra),
                    "--progress",
                    "--result-dir",
                    result_dir,
                ],
                timeout=120.0,
                on_line=on_line,
            )
            failed = [e for e in exits if e.returncode != 0]
            if failed:
                for e in failed:
                    console.print(f"[red]rank {e.rank} failed (exit {e.returncode})[/]\n{e.output}")
                return 1
            results = read_results(Path(result_dir), args.nproc)
    return summarize(console, results, joined)


def _lost_rank(parser: argparse.ArgumentParser, value: str, nproc: int, fsdp: bool) -> int:
    rank, _, iteration = value.partition("@")
    if not (rank.isdigit() and iteration.isdigit()):
        parser.error(f"--lose-rank {value}: expected RANK@ITERATION, e.g. 1@5")
    if fsdp:
        parser.error("--lose-rank with --fsdp: FSDP2 cannot go on without a lost rank; drop one of them")
    if nproc < 2 or int(rank) >= nproc:
        parser.error(f"--lose-rank {value}: rank {rank} is not one of --nproc {nproc} ranks (need 2 or more)")
    return int(rank)


def lose_rank_demo(console: Console, nproc: int, device: str, backend: str, lost: int, spec: str) -> int:
    """Run train_survivors.py with rank ``lost`` killed as ``spec`` says; check the survivors."""
    console.print(
        f"[bold]{nproc} ranks[/] on {device} over {backend}; rank {lost} is killed in iteration "
        f"{spec.partition('@')[2]}; the others go on (Join(on_rank_lost='continue'))"
    )
    with tempfile.TemporaryDirectory() as result_dir:
        script = ROOT / "integration_tests" / "train_survivors.py"
        args = ["--device", device, "--backend", backend, "--lose-rank", spec, "--result-dir", result_dir]
        console.print(
            f"$ python -m join_core.launch --nproc-per-node {nproc} {script.name} {' '.join(args[:6])}"
        )
        ended = run_launch(script, nproc, *args, timeout=120.0)
        if ended.returncode != 0:  # the agent ends with 0 when every rank but the lost one finished
            console.print(f"[red]the launch exited {ended.returncode}[/]\n{ended.output}")
            return 1
        survivors = [rank for rank in range(nproc) if rank != lost]
        results = {rank: read_results_of(Path(result_dir), rank) for rank in survivors}
    first = results[survivors[0]]
    trained = [first["lost"][lost] if rank == lost else results[rank]["batches"] for rank in range(nproc)]
    table = Table(title="summary")
    for column in ("rank", "batches trained", "slowest iteration"):
        table.add_column(column, justify="right")
    for rank in range(nproc):
        slowest = "-" if rank == lost else f"{results[rank]['slowest']:.2f} s"
        table.add_row(str(rank) + (" (lost)" if rank == lost else ""), str(len(trained[rank])), slowest)
    console.print(table)
    everything = sorted(batch for batches in trained for batch in batches)
    once = everything == sorted(set(everything)) and len(everything) == 30
    identical = all(torch.equal(first["params"], results[rank]["params"]) for rank in survivors)
    expected = reference_dense(trained, lambda ps: torch.optim.Adam(ps, lr=0.02))
    matches = torch.allclose(first["params"], expected, rtol=1e-5, atol=1e-6)
    console.print(f"every batch of the epoch trained on once: {'yes' if once else '[red]NO[/]'}")
    console.print(f"every survivor holds the same model: {'yes' if identical else '[red]NO[/]'}")
    console.print(
        "equal to a single-process run over the batches each rank trained on: "
        + ("yes" if matches else "[red]NO[/]")
    )
    return 0 if once and identical and matches else 1


def read_results_of(result_dir: Path, rank: int) -> dict[str, Any]:
    with open(result_dir / f"rank{rank}.pkl", "rb") as f:
        result: dict[str, Any] = pickle.load(f)
    return result


def device_problem(device: str, backend: str, nproc: int) -> str | None:
    """Why the ranks could not run on ``device`` over ``backend``, or None if they can."""
    if backend == "nccl" and device != "cuda":
        return "--backend nccl runs on CUDA devices only: add --device cuda, or use --backend gloo"
    if device == "cuda" and not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"--device cuda: no usable CUDA device (torch {torch.__version__}, {built}); use --device cpu"
    if backend == "nccl" and not dist.is_nccl_available():
        return f"--backend nccl: torch {torch.__version__} was built without NCCL; use --backend gloo"
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        return (
            f"--backend nccl needs a CUDA device per rank: --nproc {nproc}, but "
            f"{torch.cuda.device_count()} devices; lower --nproc or use --backend gloo"
        )
    return None


def summarize(console: Console, results: list[dict[str, Any]], joined: list[int]) -> int:
    counts = [len(r["batches"]) for r in results]
    seconds = max(r["seconds"] for r in results)
    table = Table(title="summary")
    table.add_column("rank")
    table.add_column("batches", justify="right")
    table.add_column("first loss", justify="right")
    table.add_column("last loss", justify="right")
    for rank, result in enumerate(results):
        table.add_row(
            str(rank), str(counts[rank]), f"{result['losses'][0]:.4f}", f"{result['losses'][-1]:.4f}"
        )
    console.print(table)
    identical = all(torch.equal(results[0]["params"], r["params"]) for r in results[1:])
    expected = reference_dense([r["batches"] for r in results], lambda ps: torch.optim.Adam(ps, lr=0.02))
    matches = torch.allclose(results[0]["params"], expected, rtol=1e-5, atol=1e-6)
    console.print(
        f"joined last: rank {joined[-1] if joined else '?'} (most batches: rank {counts.index(max(counts))})"
    )
    console.print(f"every rank holds the same model: {'yes' if identical else '[red]NO[/]'}")
    console.print(
        f"equal to a single-process run over the same batches: {'yes' if matches else '[red]NO[/]'}"
    )
    console.print(
        f"training: {max(counts)} iterations in {seconds:.2f} s, {max(counts) / seconds:.1f} steps/s"
    )
    return 0 if identical and matches else 1


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, on request (tests)
    start = time.monotonic()
    try:
        code = main(sys.argv[1:])
    except KeyboardInterrupt:  # the ranks were killed on the way out (launch)
        print(
            f"demo: interrupted after {time.monotonic() - start:.1f} s; every rank stopped", file=sys.stderr
        )
        sys.exit(130)
    print(f"demo finished in {time.monotonic() - start:.1f} s")
    sys.exit(code)
