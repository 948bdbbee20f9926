"""JoinDDPStrategy: Lightning's DDP strategy for ranks with different numbers of batches."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset
from torchmetrics import Metric
from typing_extensions import override

from ddp_join import DistributedDataParallel, UnevenDistributedSampler
from join_core import DEFAULT_LIVENESS_TIMEOUT, Join, ShadowCollectives
from lightning_join import _loops
from lightning_join._reductions import is_mean, mean_over_contributors
from lightning_join.evaluation import EvaluationSteps
from lightning_join.metrics import gather_all_tensors

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["JoinDDPStrategy"]

logger: logging.Logger = logging.getLogger(__name__)

_EVALUATION_STAGES = (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING, RunningStage.TESTING)


class JoinDDPStrategy(DDPStrategy):
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
        self.exact_eval = exact_eval
        self.throw_on_early_termination = throw_on_early_termination
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.liveness_timeout = liveness_timeout
        self._trainer: pl.Trainer | None = None
        self._training_join: Join | None = None
        self._evaluation_join: Join | None = None
        self._evaluation_steps: EvaluationSteps | None = None
        self._metrics: list[Metric] = []  # whose dist_sync_fn this strategy set

    # Set-up and tear-down.

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        _check_trainer(trainer)
        super().setup(trainer)
        self._trainer = trainer
        for module in self.lightning_module.modules() if self.lightning_module is not None else []:
            if isinstance(module, Metric) and module.dist_sync_fn is None:
                module.dist_sync_fn = gather_all_tensors
                self._metrics.append(module)
        if trainer.state.fn == TrainerFn.FITTING:
            _loops.wrap_training_epoch_loop(trainer.fit_loop.epoch_loop, self)
        if self.exact_eval:
            for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
                _loops.wrap_evaluation_loop(loop, self)

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
    def teardown(self) -> None:
        self._leave(self._training_join, None)
        self._leave(self._evaluation_join, None)
        self._training_join = self._evaluation_join = None
        if self._trainer is not None:
            trainer = self._trainer
            for loop in (
                trainer.fit_loop.epoch_loop,
                trainer.fit_loop.epoch_loop.val_loop,
                trainer.validate_loop,
                trainer.test_loop,
            ):
                _loops.unwrap(loop)
            self._trainer = None
        for metric in self._metrics:
            metric.dist_sync_fn = None
        self._metrics = []
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    # Data.

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """With ``exact_eval``, give a validation or test dataloader an
        :class:`ddp_join.UnevenDistributedSampler` (unless it has a
        distributed sampler already)."""
        trainer = self._trainer or getattr(self.lightning_module, "_trainer", None)
        if not self.exact_eval or trainer is None or trainer.state.stage not in _EVALUATION_STAGES:
            return dataloader
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
            return dataloader
        if isinstance(dataloader.sampler, (DistributedSampler, UnevenDistributedSampler)):
            return dataloader
        from lightning.pytorch.utilities.data import _update_dataloader

        samples = len(dataloader.dataset)  # type: ignore[arg-type]
        if samples < self.world_size:
            what = "test" if trainer.state.stage == RunningStage.TESTING else "validation"
            raise ValueError(
                f"JoinDDPStrategy(exact_eval=True): the {what} dataset has {samples} "
                f"samples for {self.world_size} ranks, so rank {self.world_size - 1} would have none, and "
                "Lightning skips evaluation on a rank without batches while the others wait for it; "
                "evaluate on at least as many samples as ranks"
            )
        sampler = UnevenDistributedSampler(
            dataloader.dataset,  # type: ignore[arg-type]
            num_replicas=self.world_size,
            rank=self.global_rank,
            shuffle=False,
        )
        return _update_dataloader(dataloader, sampler, mode=trainer.state.stage)

    # Collectives Lightning issues: exact while a rank has joined.

    @override
    def reduce(
        self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """As DDPStrategy's, except that a mean is over the ranks that
        contribute (a rank that has joined adds nothing to it instead of a
        zero), and the mean of an integer tensor is a new floating-point
        tensor rather than truncated (which made an epoch's ``sync_dist``
        mean wrong when the ranks' sample counts do not add up to a multiple
        of the world size)."""
        given: object = tensor  # Lightning passes other values through unchanged
        if is_mean(reduce_op) and isinstance(given, Tensor) and dist.is_initialized():
            return mean_over_contributors(given, group)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """As DDPStrategy's, counting only the ranks that decide (a rank that
        has joined neither agrees nor objects)."""
        if not dist.is_initialized():
            return decision
        votes = torch.tensor([1.0 if decision else 0.0, 1.0], device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes[0] == votes[1]) if all else bool(votes[0] > 0)

    # Evaluation steps.

    @override
    def on_validation_start(self) -> None:
        self._enter_evaluation()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._enter_evaluation()
        super().on_test_start()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._evaluation_step()
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._evaluation_step()
        return super().test_step(*args, **kwargs)

    def _enter_evaluation(self) -> None:
        if not self.exact_eval or self._evaluation_join is not None or not dist.is_initialized():
            return
        steps = EvaluationSteps(self.root_device)
        join = Join(
            [steps, ShadowCollectives()],
            throw_on_early_termination=False,
            liveness_timeout=self.liveness_timeout,
        )
        join.__enter__()
        self._evaluation_join = join
        self._evaluation_steps = steps

    def _evaluation_step(self) -> None:
        if not self.exact_eval or not dist.is_initialized():
            return
        if self._evaluation_join is None:  # the next dataloader of several
            self._enter_evaluation()
        assert self._evaluation_steps is not None
        self._evaluation_steps.step()

    def leave_evaluation(self, error: BaseException | None) -> None:
        """Leave the evaluation Join, if in one: after this rank's last batch,
        shadow the others' until every rank is done."""
        join, self._evaluation_join = self._evaluation_join, None
        self._leave(join, error)

    # Training batches (called by the wrapped loop).

    def enter_training(self) -> None:
        """Enter this epoch's Join, unless already in it."""
        if self._training_join is not None or not isinstance(self.model, DistributedDataParallel):
            return
        join = Join(
            [self.model, ShadowCollectives(self.model.process_group)],
            throw_on_early_termination=self.throw_on_early_termination,
            liveness_timeout=self.liveness_timeout,
            divide_by_initial_world_size=self.divide_by_initial_world_size,
        )
        join.__enter__()
        self._training_join = join

    def leave_training(self, error: BaseException | None) -> None:
        """Leave this epoch's Join, if in one, and take the training state of
        the rank that trained longest."""
        join, self._training_join = self._training_join, None
        if join is None:
            return
        self._leave(join, error)
        if error is None:
            self._take_state_of_longest_rank()

    def training_done(self) -> bool:
        """Whether this rank's training batches of the epoch are over."""
        assert self._trainer is not None
        return bool(self._trainer.fit_loop.epoch_loop._is_training_done)

    def received_sigterm(self) -> bool:
        """Whether this rank's trainer received SIGTERM."""
        return bool(getattr(self._trainer, "received_sigterm", False))

    @staticmethod
    def _leave(join: Join | None, error: BaseException | None) -> None:
        if join is None:
            return
        if error is None:
            join.__exit__(None, None, None)
        else:
            join.__exit__(type(error), error, error.__traceback__)

    def _take_state_of_longest_rank(self) -> None:
        """Every rank takes the optimizer and scheduler states and the step
        counters of the highest rank with the most batches (whose model the
        Join already gave every rank); nothing moves when all had as many."""
        trainer = self._trainer
        assert trainer is not None
        loop = trainer.fit_loop.epoch_loop
        counts = torch.zeros(self.world_size, dtype=torch.float64, device=self.root_device)
        counts[self.global_rank] = float(loop.batch_progress.current.completed)
        dist.all_reduce(counts)
        if bool((counts == counts[0]).all()):
            return
        src = int((counts == counts.max()).nonzero().max())
        state: dict[str, Any] | None = None
        if self.global_rank == src:
            state = {
                "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
                "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
                "optim_progress": loop.automatic_optimization.optim_progress.state_dict(),
                "manual_progress": loop.manual_optimization.optim_step_progress.state_dict(),
                "scheduler_progress": loop.scheduler_progress.state_dict(),
                "batches_that_stepped": loop._batches_that_stepped,
            }
        state = self.broadcast(state, src)
        assert state is not None
        if self.global_rank == src:
            return
        for optimizer, optimizer_state in zip(trainer.optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
        loop.automatic_optimization.optim_progress.load_state_dict(state["optim_progress"])
        loop.manual_optimization.optim_step_progress.load_state_dict(state["manual_progress"])
        loop.scheduler_progress.load_state_dict(state["scheduler_progress"])
        loop._batches_that_stepped = state["batches_that_stepped"]


def _check_trainer(trainer: pl.Trainer) -> None:
    """Reject Trainer settings that cannot work with uneven batches, naming the fix."""
    if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
        raise ValueError(
            "JoinDDPStrategy needs Trainer(use_distributed_sampler=False): with True, Lightning gives "
            "every rank a DistributedSampler that repeats samples until all ranks have as many batches, "
            "so training sees some samples twice and validation counts them twice. Pass "
            "use_distributed_sampler=False, give each rank its share of the training data (e.g. "
            "sampler=ddp_join.UnevenDistributedSampler(dataset)), and JoinDDPStrategy(exact_eval=True) "
            "for validation and test"
        )
    if trainer.state.fn == TrainerFn.FITTING:
        interval = trainer.val_check_interval
        if isinstance(interval, int) or interval != 1.0:
            raise ValueError(
                f"JoinDDPStrategy: Trainer(val_check_interval={interval!r}) validates in the middle of "
                "an epoch, where ranks with different numbers of batches are at different batches; "
                "use val_check_interval=1.0 (validate after each epoch, the default)"
            )
