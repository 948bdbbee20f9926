"""Losing a rank and going on: every rank trains DistributedDataParallel +
ZeroRedundancyOptimizer(shard_replicas=1) under
Join([model, optimizer], on_rank_lost="continue") on the batches an
UnevenDistributedSampler gives it; the rank named by --lose-rank R@K kills
itself (SIGKILL) in iteration K. The survivors take over its later batches
and go on; each writes what it trained on and what the Join recorded.

    python -m join_core.launch --nproc-per-node 3 integration_tests/train_survivors.py --lose-rank 1@5
    python integration_tests/launch.py --nproc 3 integration_tests/train_survivors.py --lose-rank 1@5

(torchrun would stop the survivors when the lost rank dies: it stops every
worker when one fails.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from training_common import flat, make_batch, make_model, make_parser, rank_from_env, write_result

import rpc_registry
from ddp_join import DistributedDataParallel, UnevenDistributedSampler, ZeroRedundancyOptimizer
from join_core import Join
from tensorpipe_backend import TensorPipeRpcBackendOptions

LR = 0.02


def lose_rank(value: str) -> tuple[int, int]:
    """``R@K``: rank R is lost in iteration K (from 0)."""
    rank, _, iteration = value.partition("@")
    try:
        return int(rank), int(iteration)
    except ValueError:
        raise ValueError(f"--lose-rank {value!r}: expected RANK@ITERATION, e.g. 1@5") from None


def report(enabled: bool, rank: int, **event: object) -> None:
    """One progress event as a JSON line, written at once."""
    if enabled:
        sys.stdout.write(json.dumps({"rank": rank, **event}) + "\n")
        sys.stdout.flush()


def main(argv: list[str]) -> int:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--lose-rank", type=lose_rank, default=None, help="RANK@ITERATION, e.g. 1@5")
    parser.add_argument("--batches", type=int, default=30, help="batches in the epoch, over all ranks")
    parser.add_argument("--progress", action="store_true", help="print progress as JSON lines (for the demo)")
    parser.add_argument(
        "--rpc", action="store_true", help="also start RPC, and check survivors' calls to each other after"
    )
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long in every iteration")
    parser.add_argument(
        "--mark", type=Path, default=None, help="rank 0 creates this file after its 3rd iteration (tests)"
    )
    args = parser.parse_args(argv)
    me = rank_from_env(args.device, args.backend)
    lost_rank, lost_at = args.lose_rank if args.lose_rank is not None else (-1, -1)
    dist.init_process_group(me.backend, init_method="env://", timeout=timedelta(seconds=120))
    if args.rpc:
        options = TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=20.0)
        rpc_registry.init_rpc(me.name, rank=me.rank, world_size=me.world_size, rpc_backend_options=options)
        for peer in range(me.world_size):  # connected to every worker before the loss
            rpc_registry.rpc_sync(f"worker{peer}", torch.add, args=(torch.ones(1), 0))
    batch_ids = TensorDataset(torch.arange(args.batches))
    sampler = UnevenDistributedSampler(batch_ids, shuffle=True, seed=3)
    loader: DataLoader[tuple[torch.Tensor, ...]] = DataLoader(batch_ids, batch_size=1, sampler=sampler)
    model = DistributedDataParallel(
        make_model().to(me.device), device_ids=[me.device] if me.device.type == "cuda" else None
    )
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR, shard_replicas=1)
    batches: list[int] = []
    losses: list[float] = []
    slowest = 0.0  # the longest iteration: the one in which the loss was found and recovered from
    start = last = time.monotonic()
    with Join([model, optimizer], on_rank_lost="continue") as join:
        sampler.follow(join, batch_size=1)
        for step, (batch_id,) in enumerate(loader):
            x, y = make_batch(int(batch_id), me.device)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if me.rank == lost_rank and step == lost_at:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
            batches.append(int(batch_id))
            losses.append(loss.item())
            time.sleep(args.step_seconds)
            if args.mark is not None and me.rank == 0 and len(batches) == 3:
                args.mark.touch()
            now = time.monotonic()
            slowest, last = max(slowest, now - last), now
            report(args.progress, me.rank, batch=len(batches), loss=losses[-1])
        report(args.progress, me.rank, joined=len(batches))
    seconds = time.monotonic() - start
    if args.rpc:
        survivors = [rank for rank in range(dist.get_world_size()) if rank not in join.lost_ranks]
        peer = survivors[(survivors.index(me.rank) + 1) % len(survivors)]
        answer = rpc_registry.rpc_sync(f"worker{peer}", torch.add, args=(torch.ones(2), me.rank))
        assert answer.tolist() == [me.rank + 1.0] * 2, answer
        dist.barrier(group=join.process_group)  # every survivor's call answered before any leaves
        rpc_registry.shutdown(graceful=False)
    if me.rank == 0 or (lost_rank == 0 and me.rank == 1):
        print(f"rank {me.rank}: lost {join.lost_ranks}", flush=True)
    write_result(
        args.result_dir,
        me.rank,
        {
            "batches": batches,
            "losses": losses,
            "params": flat(model.parameters()),
            "seconds": seconds,
            "slowest": slowest,
            # What each lost rank trained on: its first batches, one per iteration it took part in.
            "lost": {rank: sampler.indices_of(rank)[:count] for rank, count in join.contributions.items()},
        },
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
