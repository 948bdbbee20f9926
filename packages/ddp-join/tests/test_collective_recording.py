"""Our DDP, ZeRO and FSDPJoinable record their collectives from construction
on, so a hang report or desync error names them with the user's call site."""

from __future__ import annotations

import torch
import torch.distributed as dist

import join_core
from ddp_join import DistributedDataParallel, ZeroRedundancyOptimizer
from join_core.testing import run_ranks


def _train_and_read_records(rank: int, world_size: int) -> list[tuple[str, str]]:
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    recorder = join_core.recorder()
    assert recorder is not None
    records = recorder.records(dist.group.WORLD.group_name if dist.group.WORLD else None)
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    assert not recorder.pending()
    return [(r.op, r.call_site) for r in records]


def test_ddp_and_zero_collectives_are_recorded_with_the_users_call_site() -> None:
    per_rank = run_ranks(_train_and_read_records, 2)
    assert per_rank[0] == per_rank[1]
    ops = [op for op, _ in per_rank[0]]
    assert "broadcast" in ops and "all_reduce" in ops, ops
    sites = {site.split(" ")[0].split(":")[0] for _, site in per_rank[0]}
    assert sites == {"test_collective_recording.py"}, sites
