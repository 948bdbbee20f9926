"""A process that started RPC, but built no Join, exits cleanly even when one of
gloo's threads frees the last reference to a tensor after the script's last line."""

from __future__ import annotations

from pathlib import Path

import pytest

from join_core.testing import run_script

# join-core's deterministic reproduction, after init_rpc instead of a Join: the
# main thread keeps the GIL from the moment the reduction lands until Python
# finalizes, while gloo's thread, which alone holds the dropped Work, waits for
# the GIL to free the tensor's Python object.
SCRIPT = """
import ctypes
import sys

import torch
import torch.distributed as dist

from rpc_registry import init_rpc, shutdown
from tensorpipe_backend import TensorPipeRpcBackendOptions, ensure_registered

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
options = TensorPipeRpcBackendOptions(init_method="env://", auth_token="exit-grace-test", rpc_timeout=60)
init_rpc(f"w{rank}", ensure_registered(), rank, world_size, options)
shutdown()
sys.setswitchinterval(100.0)  # the GIL changes hands only when the main thread blocks
summed = torch.ones(1)
landed = ctypes.c_float.from_address(summed.data_ptr())
dist.all_reduce(summed, async_op=True)  # the Work is dropped at once
while landed.value != world_size:  # waits without releasing the GIL
    pass
"""


@pytest.mark.timeout(180)
def test_a_process_that_started_rpc_exits_cleanly_after_its_last_collective(tmp_path: Path) -> None:
    script = tmp_path / "exit_race.py"
    script.write_text(SCRIPT)
    for ended in run_script(script, 2, timeout=120):
        assert ended.returncode == 0, f"rank {ended.rank} exited {ended.returncode}:\n{ended.output}"
