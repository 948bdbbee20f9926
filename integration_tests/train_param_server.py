"""Parameter server + DDP: an embedding table lives on worker0 behind an RRef;
trainers look rows up by RPC and push their sparse gradients back; the dense
part is DistributedDataParallel under Join, with uneven inputs.

    python integration_tests/launch.py --nproc 3 integration_tests/train_param_server.py

The table applies an iteration's updates once every rank that trained in it
has pushed (in rank order), and a lookup for iteration i waits for the
updates of the iterations before it, so the run is deterministic.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from training_common import distributed, flat, make_parser, rank_from_env, write_result

import rpc_registry
from ddp_join import DistributedDataParallel
from rpc_registry import RRef

ROWS, DIM, LR = 32, 8, 0.1
WAIT_S = 60.0


class EmbeddingTable:
    """Rows of an embedding, updated by plain SGD from the trainers' pushes."""

    def __init__(self, world_size: int) -> None:
        # Its own generator: this runs on an RPC thread while the main thread seeds the global one.
        self.weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))
        self.world_size = world_size
        self._cond = threading.Condition()
        self._pushes: dict[
            int, dict[int, tuple[torch.Tensor, torch.Tensor]]
        ] = {}  # iteration -> rank -> update
        self._last: dict[int, int] = {}  # rank -> its last iteration, once it said so
        self._applied = 0  # iterations whose updates are in the table

    def _complete(self, iteration: int) -> bool:
        pushed = self._pushes.get(iteration, {})
        return all(r in pushed or self._last.get(r, iteration) < iteration for r in range(self.world_size))

    def _apply_ready(self) -> None:
        while self._complete(self._applied):
            pushed = self._pushes.pop(self._applied, {})
            if not pushed:
                return  # every rank finished before this iteration
            for _, (ids, grads) in sorted(pushed.items()):
                self.weight.index_add_(0, ids, grads, alpha=-LR / self.world_size)
            self._applied += 1
            self._cond.notify_all()

    def lookup(self, ids: torch.Tensor, iteration: int) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: self._applied >= iteration, timeout=WAIT_S):
                raise TimeoutError(f"lookup for iteration {iteration}: updates of earlier ones missing")
            return self.weight[ids].clone()

    def push(self, rank: int, iteration: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        with self._cond:
            self._pushes.setdefault(iteration, {})[rank] = (ids, grads)
            self._apply_ready()

    def finish(self, rank: int, last_iteration: int) -> None:
        with self._cond:
            self._last[rank] = last_iteration
            self._apply_ready()

    def snapshot(self) -> torch.Tensor:
        with self._cond:
            return self.weight.clone()


_table: RRef[EmbeddingTable] | None = None
_table_set = threading.Event()


def receive_table(rref: RRef[EmbeddingTable]) -> None:
    """Runs on every trainer: keep the table's RRef."""
    global _table
    _table = rref
    _table_set.set()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(0, ROWS, (6, 3), generator=gen)
    return ids, torch.randn(6, 1, generator=gen)


def main(argv: list[str]) -> int:
    args = make_parser(__doc__ or "").parse_args(argv)
    me = rank_from_env(args.device, args.backend)
    steps = args.base + me.rank * args.extra
    with distributed(me):
        if me.rank == 0:
            table = rpc_registry.remote("worker0", EmbeddingTable, args=(me.world_size,))
            for r in range(me.world_size):
                rpc_registry.rpc_sync(f"worker{r}", receive_table, args=(table,))
        if not _table_set.wait(timeout=WAIT_S):
            raise TimeoutError(f"rank {me.rank}: no table RRef from worker0 within {WAIT_S:.0f} s")
        assert _table is not None
        torch.manual_seed(0)
        model = DistributedDataParallel(
            torch.nn.Linear(DIM, 1).to(me.device),
            device_ids=[me.device] if me.device.type == "cuda" else None,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        with model.join():
            for step in range(steps):
                ids, y = batch(me.rank, step)
                rows = _table.rpc_sync().lookup(ids.reshape(-1), step).to(me.device).requires_grad_()
                features = rows.view(*ids.shape, DIM).sum(dim=1)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(features), y.to(me.device)).backward()
                optimizer.step()
                assert rows.grad is not None
                _table.rpc_sync().push(me.rank, step, ids.reshape(-1), rows.grad.cpu())
            # Before shadowing the others: their lookups wait to hear this rank is done.
            _table.rpc_sync().finish(me.rank, steps - 1)
        dist.barrier()
        last = max(args.base + r * args.extra for r in range(me.world_size))
        table_after = _table.rpc_sync().lookup(torch.arange(ROWS), last)
        dense = flat(model.parameters())
        dist.barrier()
    write_result(args.result_dir, me.rank, {"steps": steps, "dense": dense, "table": table_after})
    print(f"rank {me.rank}: {steps} steps")
    return 0


def reference(world_size: int, base: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same run in one process."""
    table = EmbeddingTable(world_size).weight
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    counts = [base + r * extra for r in range(world_size)]
    for step in range(max(counts)):
        dense_total = [torch.zeros_like(p) for p in model.parameters()]
        updates = []
        for rank in (r for r in range(world_size) if counts[r] > step):
            ids, y = batch(rank, step)
            rows = table[ids.reshape(-1)].clone().requires_grad_()
            model.zero_grad()
            torch.nn.functional.mse_loss(model(rows.view(*ids.shape, DIM).sum(dim=1)), y).backward()
            for acc, p in zip(dense_total, model.parameters()):
                assert p.grad is not None
                acc += p.grad
            assert rows.grad is not None
            updates.append((ids.reshape(-1), rows.grad))
        for acc, p in zip(dense_total, model.parameters()):
            p.grad = acc / world_size
        optimizer.step()
        for ids, grads in updates:
            table.index_add_(0, ids, grads, alpha=-LR / world_size)
    return flat(model.parameters()), table


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
