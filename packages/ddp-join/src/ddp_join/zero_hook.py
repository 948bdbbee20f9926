"""hook_with_zero_step: a DistributedDataParallel communication hook that
steps a ZeroRedundancyOptimizer's shard of each bucket as soon as the bucket
is reduced, during backward."""

from __future__ import annotations

from typing import Any

import torch

from ddp_join._bucket import in_bucket_layout
from ddp_join.comm_hooks import CommHook, GradBucket
from ddp_join.distributed import DistributedDataParallel
from ddp_join.zero import ZeroRedundancyOptimizer

__all__ = ["hook_with_zero_step"]


def hook_with_zero_step(
    hook: CommHook,
    ddp: DistributedDataParallel[Any],
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> CommHook:
    """Wrap ``hook`` so that, once it has reduced a bucket, each rank steps
    its parameters of that bucket with ``zero`` and every parameter of the
    bucket is broadcast from its owner; ``zero.step()`` then steps nothing
    again. Torch's ``hook_with_zero_step``, for this package's classes.

    The optimizer step of a bucket runs while backward goes on through the
    earlier layers (the bucket's reduction is waited for in the hook). Under
    ``join_core.Join([model, zero])`` a joined rank steps its shard the same
    way, with the gradients the model's join hook reduces.

    Args:
        hook: the reduction, e.g. :func:`ddp_join.allreduce_hook`.
        ddp: the model the hook is registered on.
        zero: built over ``ddp.parameters()`` with ``overlap_with_ddp=True``.
        shard_buckets: accepted for torch's signature, without effect: each
            parameter is stepped by the rank the optimizer gave it to.

    Example::

        model = DistributedDataParallel(net)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-3)
        model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
        with join_core.Join([model, zero]):
            for x, y in my_batches:
                torch.nn.functional.mse_loss(model(x), y).backward()  # steps the shards
                zero.step()  # steps nothing again
    """
    if not zero.overlap_with_ddp:
        raise ValueError(
            "hook_with_zero_step(zero=...): the optimizer was built with overlap_with_ddp=False, so its "
            "step() would step the parameters again; build it with overlap_with_ddp=True"
        )
    owned = set(zero._owner)
    missing = [name for name, p in ddp.module.named_parameters() if p.requires_grad and id(p) not in owned]
    if missing:
        raise ValueError(
            f"hook_with_zero_step(ddp=..., zero=...): the optimizer does not hold the model's parameters "
            f"{missing}; build it from ddp.parameters()"
        )

    def hook_with_zero(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        params = bucket.parameters()
        size = bucket.buffer().numel()
        reduced = in_bucket_layout(hook(state, bucket).wait(), bucket.index(), params, bucket._offsets, size)
        grads = [  # cast back from a compressing hook's dtype (fp16_compress_wrapper)
            reduced[offset : offset + param.numel()].view_as(param).to(param.dtype)
            for param, offset in zip(params, bucket._offsets)
        ]
        zero._step_bucket(params, grads)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(reduced)
        return done

    return hook_with_zero
