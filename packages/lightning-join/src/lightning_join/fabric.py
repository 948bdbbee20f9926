"""Fabric: the DDP strategy for uneven inputs, and the Join of a training loop.

::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=JoinDDPStrategy())
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    with join(fabric):
        for x, y in my_batches:  # fewer on some ranks
            optimizer.zero_grad()
            fabric.backward(loss_fn(model(x), y))
            optimizer.step()
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from ddp_join import DistributedDataParallel
from join_core import DEFAULT_LIVENESS_TIMEOUT, Join, ShadowCollectives
from join_core.liveness import check_watch_timeouts
from lightning_join._reductions import gather_from_contributors, is_mean, mean_over_contributors

__all__ = ["JoinDDPStrategy", "join"]


class JoinDDPStrategy(DDPStrategy):
    """Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` for ranks
    with different numbers of batches: ``fabric.setup(model)`` wraps the
    model in :class:`ddp_join.DistributedDataParallel`, and :meth:`join`
    (or :func:`join`) is the context of the training loop.

    ``fabric.all_reduce(..., reduce_op="mean")`` averages over the ranks that
    contribute, so a rank that has joined adds nothing to it, and
    ``fabric.all_gather()`` leaves such ranks out.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
            precision, process_group_backend, timeout, start_method: as
            Fabric's DDPStrategy's.
        throw_on_early_termination: raise on every rank as soon as one runs
            out of batches, instead of shadowing.
        divide_by_initial_world_size: True: each step's gradient is the sum
            over the ranks still training divided by the world size; False:
            divided by the number of ranks still training.
        liveness_timeout: as :class:`join_core.Join`'s.
        kwargs: passed to :class:`ddp_join.DistributedDataParallel`.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        throw_on_early_termination: bool = False,
        divide_by_initial_world_size: bool = True,
        liveness_timeout: timedelta | None = DEFAULT_LIVENESS_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        check_watch_timeouts(type(self).__name__, liveness_timeout, None)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._backward_sync_control = _NoSync()
        self.throw_on_early_termination = throw_on_early_termination
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.liveness_timeout = liveness_timeout
        self._modules: list[DistributedDataParallel[Module]] = []

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel[Module]:  # type: ignore[override]
        """Wrap ``module`` in :class:`ddp_join.DistributedDataParallel`."""
        ddp = DistributedDataParallel(
            module=module, device_ids=self._determine_ddp_device_ids(), **self._ddp_kwargs
        )
        self._modules.append(ddp)
        return ddp

    @override
    def all_reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """As Fabric's DDPStrategy's, except that a mean is over the ranks
        that contribute (and the mean of an integer tensor is a new
        floating-point tensor rather than truncated)."""
        given: object = tensor  # Lightning passes other values through unchanged
        if is_mean(reduce_op) and isinstance(given, Tensor) and dist.is_initialized():
            return mean_over_contributors(given, group)
        return super().all_reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """As Fabric's DDPStrategy's (``fabric.all_gather()``: a tensor of
        shape ``(world_size, *tensor.shape)``), except that inside :meth:`join`,
        over its group (the default), the ranks that have joined are left out:
        the first dimension is the number of ranks that gave a tensor, in rank
        order; on a GPU, finding it waits for the gather."""
        plain = super().all_gather
        models = self._modules
        if not models or not Join.is_active(models[0]):
            return plain(tensor, group=group, sync_grads=sync_grads)
        if group is not None and group != models[0].process_group:
            return plain(tensor, group=group, sync_grads=sync_grads)
        return gather_from_contributors(tensor, group, sync_grads, lambda t: plain(t, group, sync_grads))

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)

    def join(self) -> Join:
        """A :class:`join_core.Join` over every model set up so far, with
        :class:`join_core.ShadowCollectives` for the loop's other collectives
        (``fabric.all_reduce``, metric syncs): enter it around the training
        loop; ranks that run out of batches wait there for the others.

        Raises:
            RuntimeError: no model was set up with this strategy yet.
        """
        if not self._modules:
            raise RuntimeError(
                "JoinDDPStrategy.join(): no model was set up yet; call fabric.setup(model, optimizer) first"
            )
        return Join(
            [*self._modules, ShadowCollectives(self._modules[0].process_group)],
            throw_on_early_termination=self.throw_on_early_termination,
            liveness_timeout=self.liveness_timeout,
            divide_by_initial_world_size=self.divide_by_initial_world_size,
        )


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the model's ``no_sync()``."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager[Any]:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                f"fabric.no_backward_sync(module={type(module).__name__}): the module must be the one "
                "fabric.setup() returned (a ddp_join.DistributedDataParallel inside)"
            )
        return module.no_sync()


def join(fabric: Fabric) -> Join:
    """The Join of a Fabric training loop: ``with join(fabric): ...``.

    Raises:
        TypeError: the Fabric's strategy is not :class:`JoinDDPStrategy`.
    """
    strategy = fabric.strategy
    if not isinstance(strategy, JoinDDPStrategy):
        raise TypeError(
            f"lightning_join.fabric.join(fabric): the strategy is {type(strategy).__name__}; create the "
            "Fabric with strategy=lightning_join.fabric.JoinDDPStrategy()"
        )
    return strategy.join()
