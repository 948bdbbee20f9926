"""A process that built one of our Joinables but no Join exits cleanly even when
one of gloo's threads frees the last reference to a tensor after the last line."""

from __future__ import annotations

from pathlib import Path

import pytest

from join_core.testing import run_script

# The deterministic reproduction of join-core's exit-grace test, after building
# an entry point instead of a Join: the main thread keeps the GIL from the moment
# the reduction lands until Python finalizes, while gloo's thread, which alone
# holds the dropped Work, waits for the GIL to free the tensor's Python object.
SCRIPT = """
import ctypes
import sys

import torch
import torch.distributed as dist

from ddp_join import DistributedDataParallel, FSDPJoinable, ZeroRedundancyOptimizer

dist.init_process_group("gloo")
model = torch.nn.Linear(2, 2)
entry = sys.argv[1]
if entry == "ddp":
    group = dist.new_group()  # held by the model alone: freed at exit, with its threads
    held = DistributedDataParallel(model, process_group=group)
elif entry == "zero":
    group = dist.new_group()
    held = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
else:
    from torch.distributed.fsdp import fully_shard

    group = None
    fully_shard(model)
    held = FSDPJoinable(model, torch.optim.SGD(model.parameters(), lr=0.1))
sys.setswitchinterval(100.0)  # the GIL changes hands only when the main thread blocks
world_size = dist.get_world_size()
summed = torch.ones(1)
landed = ctypes.c_float.from_address(summed.data_ptr())
# Straight on the group, past any recording of torch.distributed's functions: the Work is dropped at once.
(group if group is not None else dist.group.WORLD).allreduce([summed])
del group
while landed.value != world_size:  # waits without releasing the GIL
    pass
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("entry", ["ddp", "zero", "fsdp"])
def test_a_process_holding_an_entry_point_exits_cleanly_after_its_last_collective(
    tmp_path: Path, entry: str
) -> None:
    script = tmp_path / "exit_race.py"
    script.write_text(SCRIPT)
    for ended in run_script(script, 2, entry, timeout=120):
        assert ended.returncode == 0, (
            f"rank {ended.rank} ({entry}) exited {ended.returncode}:\n{ended.output}"
        )
