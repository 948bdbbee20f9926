"""FSDP2 with uneven data: every rank trains a model sharded with
``fully_shard`` on its own number of batches (rank r: base + extra*r) under
Join([FSDPJoinable(model, optimizer)]), then evaluates it exactly: an
evaluation set split by UnevenDistributedSampler (no padding, no
duplicates, a length no world size divides) under Join, its summed loss and
count all-reduced.

    python integration_tests/launch.py --nproc 3 integration_tests/train_fsdp.py
    torchrun --nproc-per-node 3 integration_tests/train_fsdp.py
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from training_common import (
    FEATURES,
    TRUE_WEIGHTS,
    full_tensor,
    make_batch,
    make_model,
    make_parser,
    rank_from_env,
    write_result,
)

from ddp_join import FSDPJoinable, UnevenDistributedSampler
from join_core import Join

LR: Final = 0.02
#: Evaluation samples: divisible by no world size from 2 to 6.
EVAL_SAMPLES: Final = 61
EVAL_BATCH: Final = 4


def batch_ids(rank: int, count: int) -> list[int]:
    """The training batches of ``rank``: its own, disjoint from the others'."""
    return [1000 * rank + i for i in range(count)]


def eval_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(EVAL_SAMPLES, FEATURES, generator=gen)
    return TensorDataset(x, torch.tanh(x @ TRUE_WEIGHTS))


def evaluate_single_process(model: torch.nn.Module) -> tuple[float, int]:
    """The evaluation set's summed loss and sample count, in one process."""
    total = 0.0
    with torch.no_grad():
        for x, y in DataLoader(eval_dataset(), batch_size=EVAL_BATCH):
            total += float(torch.nn.functional.mse_loss(model(x), y, reduction="none").sum().double())
    return total, EVAL_SAMPLES


def report(enabled: bool, rank: int, **event: object) -> None:
    """One progress event as a JSON line, written at once."""
    if enabled:
        sys.stdout.write(json.dumps({"rank": rank, **event}) + "\n")
        sys.stdout.flush()


def main(argv: list[str]) -> int:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--progress", action="store_true", help="print progress as JSON lines (for the demo)")
    args = parser.parse_args(argv)
    me = rank_from_env(args.device, args.backend)
    dist.init_process_group(me.backend, init_method="env://", timeout=timedelta(seconds=120))
    try:
        model = make_model().to(me.device)
        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        joinable = FSDPJoinable(model, optimizer)
        batches = batch_ids(me.rank, args.base + me.rank * args.extra)
        losses: list[float] = []
        start = time.monotonic()
        with Join([joinable]):
            for done, batch_id in enumerate(batches, 1):
                x, y = make_batch(batch_id, me.device)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                report(args.progress, me.rank, batch=done, left=len(batches) - done, loss=losses[-1])
            report(args.progress, me.rank, joined=len(batches))
        seconds = time.monotonic() - start

        dataset = eval_dataset()
        sampler = UnevenDistributedSampler(dataset, shuffle=False)
        loader = DataLoader(dataset, batch_size=EVAL_BATCH, sampler=sampler)
        totals = torch.zeros(2, dtype=torch.float64, device=me.device)  # summed loss, samples
        model.eval()
        with torch.no_grad(), Join([joinable]):
            for x, y in loader:
                x, y = x.to(me.device), y.to(me.device)
                losses_per_sample = torch.nn.functional.mse_loss(model(x), y, reduction="none").sum(dim=1)
                totals[0] += losses_per_sample.double().sum()
                totals[1] += len(y)
        dist.all_reduce(totals)
        params = torch.cat([full_tensor(p).reshape(-1) for p in model.parameters()])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    eval_sum, eval_count = float(totals[0]), int(totals[1])
    report(args.progress, me.rank, done=len(batches), seconds=seconds, batches=batches)
    # The demo names the rank of each line itself.
    print(
        ("" if args.progress else f"rank {me.rank}: ")
        + f"trained on {len(batches)} batches, evaluated {len(sampler)} samples; "
        f"evaluation over all {eval_count}: mean loss {eval_sum / eval_count:.6f}"
    )
    write_result(
        args.result_dir,
        me.rank,
        {
            "batches": batches,
            "losses": losses,
            "params": params,
            "seconds": seconds,
            "eval_sum": eval_sum,
            "eval_count": eval_count,
            "eval_local": len(sampler),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
