"""JoinDDPStrategy: Lightning's DDP strategy for ranks with different numbers of batches."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from ddp_join import DistributedDataParallel
from join_core import DEFAULT_LIVENESS_TIMEOUT, Joinable, ShadowCollectives
from lightning_join._join_strategy import JoinStrategyBase
from lightning_join.evaluation import EvaluationSteps

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["JoinDDPStrategy"]

logger: logging.Logger = logging.getLogger(__name__)


class JoinDDPStrategy(JoinStrategyBase, DDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` for
    ranks with different numbers of batches.

    The model is wrapped in :class:`ddp_join.DistributedDataParallel`, and
    each epoch's training batches run under a :class:`join_core.Join` with
    :class:`join_core.ShadowCollectives`: a rank that runs out of batches
    shadows the gradient all-reduces of the others *and* every collective
    Lightning issues in the loop (``self.log(..., sync_dist=True)``,
    ``reduce_boolean_decision``, torchmetrics syncs), so nothing hangs. When
    the last rank is done, every rank takes its model, optimizer and
    learning-rate scheduler states and step counters, so all ranks agree on
    ``global_step``, checkpoints and early stopping. The torchmetrics
    metrics of the LightningModule sync with
    :func:`lightning_join.gather_all_tensors` (unless they have a
    ``dist_sync_fn`` of their own), which leaves joined ranks out.

    Each rank brings its own share of the data: use
    ``Trainer(use_distributed_sampler=False)`` and, for example,
    :class:`ddp_join.UnevenDistributedSampler` in the train dataloader.

    ``accelerator``, ``parallel_devices``, ``cluster_environment``,
    ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``,
    ``timeout`` and ``start_method`` are as
    :class:`~lightning.pytorch.strategies.DDPStrategy`'s; ``ddp_comm_state``
    and ``ddp_comm_hook`` are a communication hook registered with
    :meth:`ddp_join.DistributedDataParallel.register_comm_hook` (on any
    device, not only CUDA).

    Args:
        ddp_comm_wrapper: not supported (must be None): wrap the hook yourself.
        model_averaging_period: not supported (must be None): post-local SGD
            needs torch's own DistributedDataParallel.
        exact_eval: give validation and test dataloaders an
            :class:`ddp_join.UnevenDistributedSampler` (every sample on
            exactly one rank) and run their batches under a Join, so metrics
            logged with ``sync_dist=True`` and torchmetrics equal the
            single-process values for any dataset length and world size.
        throw_on_early_termination: raise on every rank as soon as one runs
            out of training batches, instead of shadowing.
        divide_by_initial_world_size: True: each step's gradient is the sum
            over the ranks still training divided by the world size; False:
            divided by the number of ranks still training.
        liveness_timeout: as :class:`join_core.Join`'s: a rank silent this
            long is lost and named on every other rank; None turns the watch
            off.
        kwargs: passed to :class:`ddp_join.DistributedDataParallel`
            (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ...).

    Example::

        trainer = Trainer(
            strategy=JoinDDPStrategy(exact_eval=True),
            use_distributed_sampler=False,
            accelerator="cpu",
            devices=2,
        )
    """

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable[..., Any] | None = None,
        ddp_comm_wrapper: Callable[..., Any] | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        exact_eval: bool = False,
        throw_on_early_termination: bool = False,
        divide_by_initial_world_size: bool = True,
        liveness_timeout: timedelta | None = DEFAULT_LIVENESS_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if ddp_comm_wrapper is not None:
            raise ValueError(
                f"JoinDDPStrategy(ddp_comm_wrapper={ddp_comm_wrapper!r}): not supported; pass a hook that "
                "compresses itself as ddp_comm_hook (e.g. ddp_join.fp16_compress_hook)"
            )
        if model_averaging_period is not None:
            raise ValueError(
                f"JoinDDPStrategy(model_averaging_period={model_averaging_period}): post-local SGD model "
                "averaging needs torch's own DistributedDataParallel; use Lightning's DDPStrategy for it"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._init_join(
            exact_eval, throw_on_early_termination, divide_by_initial_world_size, liveness_timeout
        )
        self._evaluation_steps: EvaluationSteps | None = None

    # Set-up and tear-down.

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel[Module]:  # type: ignore[override]
        """Wrap the model in :class:`ddp_join.DistributedDataParallel`."""
        device_ids = self.determine_ddp_device_ids()
        logger.debug("wrapping the model in ddp_join.DistributedDataParallel: %s", self._ddp_kwargs)
        return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            assert isinstance(self.model, DistributedDataParallel)
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (``no_sync``) between optimizer steps."""
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    @override
    def _check_trainer(self, trainer: pl.Trainer) -> None:
        super()._check_trainer(trainer)
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"JoinDDPStrategy: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not "
                "supported (a rank out of batches shadows one syncing forward and gradient all-reduce per batch "
                "of the others, and a rank steps at its own last batch); use accumulate_grad_batches=1 and a "
                "larger batch"
            )

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """As DDPStrategy's, for our wrapper: with manual optimization the
        backward runs inside its forward, so it learns first what the loss
        reaches (``find_unused_parameters``: the others keep ``.grad`` None)."""
        module = self.lightning_module
        if (
            isinstance(self.model, DistributedDataParallel)
            and module is not None
            and not module.automatic_optimization
        ):
            self.model.prepare_for_backward(closure_loss)
            return
        super().pre_backward(closure_loss)

    @override
    def teardown(self) -> None:
        self._leave_all()
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    @override
    def _manual_rule(self) -> str:
        return (
            "a rank out of batches shadows one gradient all-reduce, that of one backward, per batch of "
            "the others; compute one loss and call self.manual_backward() once in every training_step"
        )

    # The joinables.

    @override
    def _training_joinables(self) -> Sequence[Joinable] | None:
        if not isinstance(self.model, DistributedDataParallel):
            return None
        return [self.model, ShadowCollectives(self.model.process_group)]

    @override
    def _evaluation_joinables(self) -> Sequence[Joinable]:
        steps = EvaluationSteps(self.root_device)
        self._evaluation_steps = steps
        return [steps, ShadowCollectives()]

    @override
    def _on_evaluation_step(self) -> None:
        if self._evaluation_steps is not None:
            self._evaluation_steps.step()
