"""Data-parallel training and a sharded optimizer, correct with uneven inputs.

:class:`DistributedDataParallel`, :class:`ZeroRedundancyOptimizer` and
:class:`FSDPJoinable` (for FSDP2 models) are Joinables of :mod:`join_core`:
train under ``with model.join():`` or ``join_core.Join([model, optimizer])``
when ranks have different numbers of batches. :class:`UnevenDistributedSampler` splits a dataset with neither
padding nor duplicates, for exact evaluation under Join.
"""

from typing import TYPE_CHECKING

from ddp_join.comm_hooks import (
    CommHook,
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from ddp_join.distributed import DistributedDataParallel, MixedPrecisionConfig
from ddp_join.sampler import UnevenDistributedSampler
from ddp_join.zero import ZeroRedundancyOptimizer
from ddp_join.zero_hook import hook_with_zero_step

if TYPE_CHECKING:
    from ddp_join.fsdp import FSDPJoinable
else:

    def __getattr__(name: str) -> object:
        # FSDPJoinable brings FSDP2 and DTensor (a second of CPU to import): only when asked for.
        if name == "FSDPJoinable":
            from ddp_join.fsdp import FSDPJoinable

            return FSDPJoinable
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


__version__ = "0.2.0"
"""This distribution's version (see CHANGELOG.md)."""

__all__ = [
    "CommHook",
    "DistributedDataParallel",
    "FSDPJoinable",
    "GradBucket",
    "MixedPrecisionConfig",
    "UnevenDistributedSampler",
    "ZeroRedundancyOptimizer",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "hook_with_zero_step",
]
