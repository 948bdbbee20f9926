"""What the Join strategies share: the Trainer checks, the loops' Join, the
exact reductions, exact evaluation and the state taken from the longest rank.

:class:`lightning_join.JoinDDPStrategy` and
:class:`lightning_join.JoinFSDPStrategy` put :class:`JoinStrategyBase`
before their Lightning strategy; each says which joinables its Joins hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset
from torchmetrics import Metric
from typing_extensions import override

from ddp_join import UnevenDistributedSampler
from join_core import Join, Joinable
from join_core.liveness import check_watch_timeouts
from lightning_join import _loops
from lightning_join._reductions import gather_from_contributors, is_mean, mean_over_contributors
from lightning_join.metrics import gather_all_tensors

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["JoinStrategyBase"]

_EVALUATION_STAGES = (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING, RunningStage.TESTING)


class JoinStrategyBase(ParallelStrategy):
    """The part of a Join strategy that does not depend on how the model is
    distributed. Subclasses call :meth:`_init_join` in ``__init__`` and
    implement :meth:`_training_joinables` and :meth:`_evaluation_joinables`."""

    exact_eval: bool
    throw_on_early_termination: bool
    divide_by_initial_world_size: bool
    liveness_timeout: timedelta | None
    _trainer: pl.Trainer | None
    _training_join: Join | None
    _evaluation_join: Join | None
    _metrics: list[Metric]
    #: With manual optimization, how many ``manual_backward()`` calls and
    #: optimizer steps every ``training_step`` makes (None: any number).
    _manual_backwards: ClassVar[int | None] = 1
    _manual_steps: ClassVar[int | None] = None
    _manual_calls: dict[str, int] | None  # in a manual training_step: its calls so far

    def _init_join(
        self,
        exact_eval: bool,
        throw_on_early_termination: bool,
        divide_by_initial_world_size: bool,
        liveness_timeout: timedelta | None,
    ) -> None:
        # Here, not at the first Join: that runs in every rank, after the launch.
        check_watch_timeouts(type(self).__name__, liveness_timeout, None)
        self.exact_eval = exact_eval
        self.throw_on_early_termination = throw_on_early_termination
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.liveness_timeout = liveness_timeout
        self._trainer = None
        self._training_join = None
        self._evaluation_join = None
        self._metrics = []  # whose dist_sync_fn this strategy set
        self._manual_calls = None

    # What subclasses say.

    def _training_joinables(self) -> Sequence[Joinable] | None:
        """The joinables of an epoch's training Join (None: no Join)."""
        raise NotImplementedError

    def _evaluation_joinables(self) -> Sequence[Joinable]:
        """The joinables of an evaluation Join."""
        raise NotImplementedError

    def _on_evaluation_step(self) -> None:
        """Called at the start of each evaluation step inside its Join."""

    def _manual_rule(self) -> str:
        """Why a manual ``training_step`` must make the calls it must, and how."""
        raise NotImplementedError

    def _epoch_record(self) -> Any:
        """What the longest rank sends the others after an epoch, for
        :meth:`_check_epoch_record` (None: nothing)."""
        return None

    def _check_epoch_record(self, record: Any, src: int) -> None:
        """After an uneven epoch, on every rank: check that this rank followed
        rank ``src`` (the longest) as ``record`` tells, raising on every rank
        if one did not. Nothing to check by default."""

    def _take_optimizer_states(self) -> bool:
        """Whether ranks take the longest rank's whole optimizer states after
        an epoch (False: only their hyperparameters, the states being shards)."""
        return True

    # Set-up and tear-down.

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._check_trainer(trainer)
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

    def _leave_all(self) -> None:
        """Leave any Join, put the loops' methods and the metrics' sync back."""
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

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        """Reject Trainer settings that cannot work with uneven batches, naming the fix."""
        name = type(self).__name__
        if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise ValueError(
                f"{name} needs Trainer(use_distributed_sampler=False): with True, Lightning gives "
                "every rank a DistributedSampler that repeats samples until all ranks have as many batches, "
                "so training sees some samples twice and validation counts them twice. Pass "
                "use_distributed_sampler=False, give each rank its share of the training data (e.g. "
                f"sampler=ddp_join.UnevenDistributedSampler(dataset)), and {name}(exact_eval=True) "
                "for validation and test"
            )
        if trainer.state.fn == TrainerFn.FITTING:
            seconds = getattr(trainer, "_val_check_time_interval", None)
            if seconds is not None:
                raise ValueError(
                    f"{name}: a time-based Trainer(val_check_interval=...) ({seconds:g} s) validates when "
                    "that time has passed, in the middle of an epoch, where ranks with different numbers of "
                    "batches are at different batches; use val_check_interval=1.0 (validate after each "
                    "epoch, the default)"
                )
            interval = trainer.val_check_interval
            if isinstance(interval, int) or interval != 1.0:
                raise ValueError(
                    f"{name}: Trainer(val_check_interval={interval!r}) validates in the middle of "
                    "an epoch, where ranks with different numbers of batches are at different batches; "
                    "use val_check_interval=1.0 (validate after each epoch, the default)"
                )
            for callback in trainer.checkpoint_callbacks:
                _check_checkpoint_interval(name, callback)
            for other in getattr(trainer, "callbacks", []):
                _check_timer_interval(name, other)

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
                f"{type(self).__name__}(exact_eval=True): the {what} dataset has {samples} "
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
        """As Lightning's, except that a mean is over the ranks that
        contribute (a rank that has joined adds nothing to it instead of a
        zero), and the mean of an integer tensor is a new floating-point
        tensor rather than truncated (which made an epoch's ``sync_dist``
        mean wrong when the ranks' sample counts do not add up to a multiple
        of the world size)."""
        given: object = tensor  # Lightning passes other values through unchanged
        if is_mean(reduce_op) and isinstance(given, Tensor) and dist.is_initialized():
            return mean_over_contributors(given, group)
        # The Lightning strategy after this class in the MRO implements it.
        return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[safe-super]

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """As Lightning's (``self.all_gather()``: a tensor of shape
        ``(world_size, *tensor.shape)``), except that inside the training or
        evaluation Join, over its group (the default), ranks that have joined
        are left out: they shadow the gather with zeros, and a flag riding
        with the values tells those rows apart. The first dimension is the
        number of ranks that gave a tensor, in rank order (the world size
        while every rank has batches); on a GPU, finding it waits for the
        gather."""
        plain = super().all_gather
        join = self._training_join if self._training_join is not None else self._evaluation_join
        if join is None or (group is not None and group != join.process_group):
            return plain(tensor, group=group, sync_grads=sync_grads)
        return gather_from_contributors(tensor, group, sync_grads, lambda t: plain(t, group, sync_grads))

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """As Lightning's, counting only the ranks that decide (a rank that
        has joined neither agrees nor objects)."""
        if not dist.is_initialized():
            return decision
        votes = torch.tensor([1.0 if decision else 0.0, 1.0], device=self.root_device)
        dist.all_reduce(votes)
        return bool(votes[0] == votes[1]) if all else bool(votes[0] > 0)

    # Manual optimization: the calls of one training step, which a rank out of
    # batches shadows once per batch of the others.

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """As Lightning's; with manual optimization, a step that makes more or
        fewer ``manual_backward()`` calls or optimizer steps than a rank out
        of batches can shadow raises ``ValueError`` naming the fix."""
        module = self.lightning_module
        if module is None or module.automatic_optimization:
            return super().training_step(*args, **kwargs)
        self._manual_calls = calls = {"backward": 0, "step": 0}
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self._manual_calls = None
        for what, count in calls.items():
            if self._manual_limit(what) not in (None, count):
                raise self._manual_error(what, count)
        return output

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """As Lightning's; counted in a manual ``training_step``."""
        self._count_manual("backward")
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """As Lightning's; counted in a manual ``training_step``."""
        self._count_manual("step")
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _count_manual(self, what: str) -> None:
        calls = self._manual_calls
        if calls is None:
            return
        calls[what] += 1
        limit = self._manual_limit(what)
        if limit is not None and calls[what] > limit:
            raise self._manual_error(what, calls[what])

    def _manual_limit(self, what: str) -> int | None:
        return self._manual_backwards if what == "backward" else self._manual_steps

    def _manual_error(self, what: str, count: int) -> ValueError:
        call = "self.manual_backward()" if what == "backward" else "the optimizer's step()"
        times = "once" if self._manual_limit(what) == 1 else f"{self._manual_limit(what)} times"
        return ValueError(
            f"{type(self).__name__}: with manual optimization (automatic_optimization=False), every "
            f"training_step must call {call} {times}; this one called it {count} "
            f"{'time' if count == 1 else 'times'}: {self._manual_rule()}"
        )

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
        join = Join(
            list(self._evaluation_joinables()),
            throw_on_early_termination=False,
            liveness_timeout=self.liveness_timeout,
        )
        join.__enter__()
        self._evaluation_join = join

    def _evaluation_step(self) -> None:
        if not self.exact_eval or not dist.is_initialized():
            return
        if self._evaluation_join is None:  # the next dataloader of several
            self._enter_evaluation()
        self._on_evaluation_step()

    def leave_evaluation(self, error: BaseException | None) -> None:
        """Leave the evaluation Join, if in one: after this rank's last batch,
        shadow the others' until every rank is done."""
        join, self._evaluation_join = self._evaluation_join, None
        self._leave(join, error)

    # Training batches (called by the wrapped loop).

    def enter_training(self) -> None:
        """Enter this epoch's Join, unless already in it."""
        if self._training_join is not None:
            return
        joinables = self._training_joinables()
        if joinables is None:
            return
        join = Join(
            list(joinables),
            throw_on_early_termination=self.throw_on_early_termination,
            liveness_timeout=self.liveness_timeout,
            divide_by_initial_world_size=self.divide_by_initial_world_size,
        )
        join.__enter__()
        self._training_join = join

    def leave_training(self, error: BaseException | None, validates: bool = False) -> bool:
        """Leave this epoch's Join, if in one, and take the training state of
        the rank that trained longest. Returns whether every rank validates
        next, ``validates`` saying whether this one would (outside a Join,
        ``validates`` itself)."""
        join, self._training_join = self._training_join, None
        if join is None:
            return validates
        self._leave(join, error)
        if error is not None:
            return False
        return self._take_state_of_longest_rank(validates)

    def training_done(self) -> bool:
        """Whether this rank's training batches of the epoch are over."""
        assert self._trainer is not None
        return bool(self._trainer.fit_loop.epoch_loop._is_training_done)

    def received_sigterm(self) -> bool:
        """Whether this rank's trainer received SIGTERM."""
        return bool(getattr(self._trainer, "received_sigterm", False))

    def in_training_join(self) -> bool:
        """Whether this rank is inside an epoch's training Join."""
        return self._training_join is not None

    @staticmethod
    def _leave(join: Join | None, error: BaseException | None) -> None:
        if join is None:
            return
        if error is None:
            join.__exit__(None, None, None)
        else:
            join.__exit__(type(error), error, error.__traceback__)

    def _take_state_of_longest_rank(self, validates: bool) -> bool:
        """Every rank takes the optimizer (or, when sharded, its
        hyperparameters), scheduler and precision plugin (the fp16 loss
        scale) states and the step counters of the highest rank with the
        most batches; nothing moves when all had as many. A rank that
        shadowed the others' batches drops the gradients their reductions
        left in its ``.grad``: they are no gradient of its own, and a manual
        ``zero_grad()`` after the step would not clear them before its next
        backward.

        Returns whether every rank ``validates``: a rank that ran out of
        batches would validate where the longest, stopped by ``max_steps``
        before its last batch, would not (nor would any rank with even
        batches)."""
        trainer = self._trainer
        assert trainer is not None
        loop = trainer.fit_loop.epoch_loop
        counts = torch.zeros(self.world_size + 1, dtype=torch.float64, device=self.root_device)
        counts[self.global_rank] = float(loop.batch_progress.current.completed)
        counts[-1] = 1.0 if validates else 0.0
        dist.all_reduce(counts)
        every_rank_validates = bool(counts[-1] == self.world_size)
        counts = counts[:-1]
        if bool((counts == counts[0]).all()):
            return every_rank_validates
        if counts[self.global_rank] < counts.max() and self.lightning_module is not None:
            self.lightning_module.zero_grad(set_to_none=True)
        src = int((counts == counts.max()).nonzero().max())
        whole = self._take_optimizer_states()
        state: dict[str, Any] | None = None
        if self.global_rank == src:
            state = {
                "optimizers": [
                    optimizer.state_dict() if whole else _hyperparameters(optimizer)
                    for optimizer in trainer.optimizers
                ],
                "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
                "precision": trainer.precision_plugin.state_dict(),
                "optim_progress": loop.automatic_optimization.optim_progress.state_dict(),
                "manual_progress": loop.manual_optimization.optim_step_progress.state_dict(),
                "scheduler_progress": loop.scheduler_progress.state_dict(),
                "batches_that_stepped": loop._batches_that_stepped,
                "epoch_record": self._epoch_record(),
            }
        state = self.broadcast(state, src)
        assert state is not None
        self._check_epoch_record(state["epoch_record"], src)
        if self.global_rank == src:
            return every_rank_validates
        for optimizer, optimizer_state in zip(trainer.optimizers, state["optimizers"]):
            if whole:
                optimizer.load_state_dict(optimizer_state)
            else:
                for group, hyperparameters in zip(optimizer.param_groups, optimizer_state):
                    group.update(hyperparameters)
        for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
        trainer.precision_plugin.load_state_dict(state["precision"])
        loop.automatic_optimization.optim_progress.load_state_dict(state["optim_progress"])
        loop.manual_optimization.optim_step_progress.load_state_dict(state["manual_progress"])
        loop.scheduler_progress.load_state_dict(state["scheduler_progress"])
        loop._batches_that_stepped = state["batches_that_stepped"]
        return every_rank_validates


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups without their parameters (lr, momentum, ...)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _check_timer_interval(strategy: str, callback: object) -> None:
    """Reject a Timer that checks the time after every batch, naming the fix."""
    if isinstance(callback, Timer) and callback._duration is not None and callback._interval == "step":
        raise ValueError(
            f"{strategy}: Timer(interval='step') (the one Trainer(max_time=...) adds) broadcasts rank 0's "
            "decision to stop after every batch, which a rank out of batches cannot take part in; pass "
            "callbacks=[Timer(duration=..., interval='epoch')] instead of max_time (the time is checked "
            "after each epoch)"
        )


def _check_checkpoint_interval(strategy: str, callback: object) -> None:
    """Reject a checkpoint callback that saves in the middle of an epoch, naming the fix."""
    steps = getattr(callback, "_every_n_train_steps", 0) or 0
    interval = getattr(callback, "_train_time_interval", None)
    if not steps and interval is None:
        return
    setting = f"every_n_train_steps={steps}" if steps else f"train_time_interval={interval!r}"
    raise ValueError(
        f"{strategy}: {type(callback).__name__}({setting}) saves in the middle of an epoch, where a rank "
        "that has run out of batches cannot take part in the checkpoint's collectives (nor in the "
        "broadcast of rank 0's decision to save); leave every_n_train_steps and train_time_interval "
        "unset and save after epochs (every_n_epochs, 1 by default)"
    )
