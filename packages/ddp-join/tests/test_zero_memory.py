"""ZeroRedundancyOptimizer's step needs no more memory than torch's."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from collections.abc import Callable

import pytest
import torch

from ddp_join import ZeroRedundancyOptimizer
from join_core.testing import run_ranks

LAYERS, WIDTH = 8, 1024  # 32 MiB of parameters, a 16 MiB shard per rank
MIB = 1 << 20
#: Allowed excess over torch's peak: the allocator's noise, well under the
#: shard (16 MiB) that a copy of it would add.
SLACK_MIB = 4.0


#: glibc's mallopt() parameter for the size above which memory is mmapped.
M_MMAP_THRESHOLD = -3


def exact_resident_memory() -> None:
    """Make glibc map every block of 64 KiB or more on its own and unmap it
    when freed, so that the resident size follows the live tensors rather
    than what the allocator kept from earlier steps (this process only)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert found is not None, field
    return int(found.group(1))


def peak_growth_mib(step: Callable[[], object]) -> float:
    """How far the resident memory rose above where it was while ``step()`` ran."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak (VmHWM) to the current resident size
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) / 1024


def _step_peaks(rank: int, world_size: int) -> dict[str, float]:
    # Imported here: torch.distributed.optim warns of a deprecation at import.
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeroRedundancyOptimizer

    exact_resident_memory()
    peaks: dict[str, float] = {}
    for name, make, bucket_view in (
        ("ours", ZeroRedundancyOptimizer, False),
        ("torch", TorchZeroRedundancyOptimizer, False),
        ("ours-view", ZeroRedundancyOptimizer, True),
        ("torch-view", TorchZeroRedundancyOptimizer, True),
    ):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        optimizer = make(model.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=1e-3)
        model(torch.randn(2, WIDTH)).sum().backward()
        peaks[name] = peak_growth_mib(optimizer.step)  # the first step allocates Adam's state
        model(torch.randn(2, WIDTH)).sum().backward()
        peaks[name + "-again"] = peak_growth_mib(optimizer.step)
        del model, optimizer
    return peaks


needs_peak_reset = pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK) or ctypes.util.find_library("c") is None,
    reason="needs Linux's peak-RSS reset and a C library with mallopt()",
)


@needs_peak_reset
def test_step_peak_memory_is_at_most_torch_zero_in_both_modes() -> None:
    for peaks in run_ranks(_step_peaks, 2, timeout=120):
        for mode in ("", "-view"):
            for step in ("", "-again"):
                assert peaks[f"ours{mode}{step}"] <= peaks[f"torch{mode}{step}"] + SLACK_MIB, peaks


def _replica_refresh_peak(rank: int, world_size: int) -> tuple[float, float]:
    """How far the resident memory rose while the replicas were made again
    (as after a lost rank), and the shard's optimizer state, in MiB."""
    exact_resident_memory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3, shard_replicas=1)
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    state = sum(
        value.numel() * value.element_size()
        for values in optimizer.optim.state.values()
        for value in values.values()
        if isinstance(value, torch.Tensor)
    )
    return peak_growth_mib(optimizer._refresh_replicas), state / MIB


@needs_peak_reset
def test_making_the_replicas_again_holds_two_shards_of_state_not_every_one() -> None:
    # After a loss every rank gets its predecessor's shard of optimizer state:
    # a rank must not hold every rank's (the whole optimizer state, on a GPU
    # under NCCL) to keep one, or recovering a large model runs out of memory.
    for peak, shard in run_ranks(_replica_refresh_peak, 4, timeout=120):
        assert peak < 6 * shard, (peak, shard)
