"""A process that built a Join exits cleanly even when one of gloo's threads
frees the last reference to a tensor after the script's last line."""

from __future__ import annotations

from pathlib import Path

from join_core.testing import run_script

# Made deterministic: the main thread keeps the GIL from the moment the
# reduction lands until Python finalizes, while gloo's thread, which alone
# holds the dropped Work, waits for the GIL to free the tensor's Python object.
SCRIPT = """
import ctypes
import sys

import torch
import torch.distributed as dist

from join_core import Join, ShadowCollectives

dist.init_process_group("gloo")
Join([ShadowCollectives()])
sys.setswitchinterval(100.0)  # the GIL changes hands only when the main thread blocks
world_size = dist.get_world_size()
summed = torch.ones(1)
landed = ctypes.c_float.from_address(summed.data_ptr())
dist.all_reduce(summed, async_op=True)  # the Work is dropped at once
while landed.value != world_size:  # waits without releasing the GIL
    pass
# No destroy_process_group(): it would release the GIL. With a model holding
# the group, as FSDP2's does, it would not join gloo's threads anyway.
"""


def test_join_process_exits_cleanly_when_gloo_frees_a_tensor_after_the_last_line(tmp_path: Path) -> None:
    script = tmp_path / "exit_race.py"
    script.write_text(SCRIPT)
    for ended in run_script(script, 2, timeout=120):
        assert ended.returncode == 0, f"rank {ended.rank} exited {ended.returncode}:\n{ended.output}"
