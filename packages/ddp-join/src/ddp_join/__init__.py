"""Data-parallel training and a sharded optimizer, correct with uneven inputs.

:class:`DistributedDataParallel` and :class:`ZeroRedundancyOptimizer` are
Joinables of :mod:`join_core`: train under ``with model.join():`` or
``join_core.Join([model, optimizer])`` when ranks have different numbers of
batches.
"""

from ddp_join.comm_hooks import CommHook, GradBucket, allreduce_hook, fp16_compress_hook
from ddp_join.distributed import DistributedDataParallel, MixedPrecisionConfig
from ddp_join.zero import ZeroRedundancyOptimizer
from ddp_join.zero_hook import hook_with_zero_step

__all__ = [
    "CommHook",
    "DistributedDataParallel",
    "GradBucket",
    "MixedPrecisionConfig",
    "ZeroRedundancyOptimizer",
    "allreduce_hook",
    "fp16_compress_hook",
    "hook_with_zero_step",
]
