"""Coordinated uneven data: a data coordinator on worker0 hands out batches on
request, each rank with its own quota, so ranks end with different batch
counts; every rank trains DistributedDataParallel + ZeroRedundancyOptimizer
under Join([model, optimizer]).

    python integration_tests/launch.py --nproc 3 integration_tests/train_coordinated.py
    torchrun --nproc-per-node 3 integration_tests/train_coordinated.py
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from training_common import (
    distributed,
    flat,
    make_batch,
    make_model,
    make_parser,
    rank_from_env,
    write_result,
)

import rpc_registry
from ddp_join import DistributedDataParallel, ZeroRedundancyOptimizer
from join_core import Join

LR = 0.02


class Coordinator:
    """Lives on worker0: gives each rank batch ids until its quota is used."""

    def __init__(self, quotas: list[int]) -> None:
        self._lock = threading.Lock()
        self._left = list(quotas)
        self._next_id = 0

    def next_batch(self, rank: int) -> tuple[int, int] | None:
        """The next batch id for ``rank`` and how many it has left after it."""
        with self._lock:
            if self._left[rank] == 0:
                return None
            self._left[rank] -= 1
            self._next_id += 1
            return self._next_id - 1, self._left[rank]


_coordinator: Coordinator | None = None
_ready = threading.Event()


def next_batch(rank: int) -> tuple[int, int] | None:
    """Runs on worker0 for any rank."""
    if not _ready.wait(timeout=60):
        raise TimeoutError("worker0: the data coordinator was not set up within 60 s")
    assert _coordinator is not None
    return _coordinator.next_batch(rank)


def report(enabled: bool, rank: int, **event: object) -> None:
    """One progress event as a JSON line, written at once."""
    if enabled:
        sys.stdout.write(json.dumps({"rank": rank, **event}) + "\n")
        sys.stdout.flush()


def main(argv: list[str]) -> int:
    global _coordinator
    parser = make_parser(__doc__ or "")
    parser.add_argument("--progress", action="store_true", help="print progress as JSON lines (for the demo)")
    args = parser.parse_args(argv)
    me = rank_from_env(args.device, args.backend)
    if me.rank == 0:
        _coordinator = Coordinator([args.base + r * args.extra for r in range(me.world_size)])
        _ready.set()
    with distributed(me):
        model = DistributedDataParallel(
            make_model().to(me.device), device_ids=[me.device] if me.device.type == "cuda" else None
        )
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
        batches: list[int] = []
        losses: list[float] = []
        start = time.monotonic()
        with Join([model, optimizer]):
            while (handed := rpc_registry.rpc_sync("worker0", next_batch, args=(me.rank,))) is not None:
                batch_id, left = handed
                x, y = make_batch(batch_id, me.device)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                batches.append(batch_id)
                losses.append(loss.item())
                report(args.progress, me.rank, batch=len(batches), left=left, loss=losses[-1])
            report(args.progress, me.rank, joined=len(batches))
        seconds = time.monotonic() - start
        params = flat(model.parameters())
        dist.barrier()
    report(args.progress, me.rank, done=len(batches), seconds=seconds, batches=batches)
    if not args.progress:
        print(f"rank {me.rank}: trained on {len(batches)} batches, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    write_result(
        args.result_dir, me.rank, {"batches": batches, "losses": losses, "params": params, "seconds": seconds}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
