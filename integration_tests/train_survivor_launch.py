"""Survivors: DistributedDataParallel under Join(on_rank_lost="continue");
one rank kills itself (SIGKILL) in the forward pass of one iteration, and the
others go on without it and finish. Each rank that finishes writes its
parameters and what the Join saw.

    python -m join_core.launch --nproc-per-node 3 integration_tests/train_survivor_launch.py --lose-rank 2
    python -m join_core.launch --nproc-per-node 3 integration_tests/train_survivor_launch.py --lose-rank 0

With ``--store-file PATH`` rank 0's process serves the store itself (as when
a script is launched by hand with MASTER_ADDR): then its loss cannot be
survived, and Join says so.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from training_common import flat, make_batch, make_model, make_parser, rank_from_env, write_result

from ddp_join import DistributedDataParallel
from join_core import Join

LR = 0.1

# torch's stubs do not re-export the store class it documents publicly.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]


def batch_id(rank: int, step: int) -> int:
    return 100 * rank + step


def _store_on_rank_0(rank: int, port_file: Path) -> Any:
    """A TCPStore served by rank 0's process on a port the OS picks, told to the others through a file."""
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        port_file.with_suffix(".tmp").write_text(str(store.port))
        port_file.with_suffix(".tmp").rename(port_file)
        return store
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 wrote no store port to {port_file} within 60 s")
        time.sleep(0.05)
    port = int(port_file.read_text())
    return TCPStore("127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=20))


def main(argv: list[str]) -> int:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--steps", type=int, default=8, help="iterations every rank trains")
    parser.add_argument("--lose-rank", type=int, default=2, help="the rank that kills itself (-1: none)")
    parser.add_argument("--lose-at", type=int, default=3, help="the iteration (from 0) it dies in")
    parser.add_argument("--liveness", type=float, default=2.0, help="Join's liveness timeout in seconds")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each iteration sleeps")
    parser.add_argument(
        "--store-file", type=Path, default=None, help="rank 0 serves the store and writes its port here"
    )
    args = parser.parse_args(argv)
    me = rank_from_env(args.device, args.backend)
    if args.store_file is None:
        dist.init_process_group(me.backend, timeout=timedelta(seconds=60))
    else:
        store = _store_on_rank_0(me.rank, args.store_file)
        dist.init_process_group(
            me.backend, store=store, rank=me.rank, world_size=me.world_size, timeout=timedelta(seconds=20)
        )
    model = DistributedDataParallel(make_model().to(me.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with Join([model], on_rank_lost="continue", liveness_timeout=timedelta(seconds=args.liveness)) as join:
        for step in range(args.steps):
            optimizer.zero_grad()
            x, y = make_batch(batch_id(me.rank, step), me.device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            time.sleep(args.step_time)
            if me.rank == args.lose_rank and step == args.lose_at:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
    write_result(
        args.result_dir,
        me.rank,
        {
            "params": flat(model.parameters()),
            "lost": sorted(join.lost_ranks),
            "group_size": dist.get_world_size(join.process_group),
        },
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
