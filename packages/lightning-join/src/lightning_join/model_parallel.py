"""JoinFSDPStrategy: Lightning's FSDP2 strategy for ranks with different numbers of batches."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from ddp_join import FSDPJoinable
from join_core import DEFAULT_LIVENESS_TIMEOUT, Joinable, ShadowCollectives
from lightning_join._join_strategy import JoinStrategyBase

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["JoinFSDPStrategy"]


class JoinFSDPStrategy(JoinStrategyBase, ModelParallelStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
    (FSDP2: the model sharded with ``fully_shard`` in ``configure_model()``)
    for ranks with different numbers of batches.

    Each epoch's training batches run under a :class:`join_core.Join` with
    :class:`ddp_join.FSDPJoinable` and :class:`join_core.ShadowCollectives`:
    a rank that runs out of batches replays the sharded model's forward and
    backward on an empty batch (so FSDP's all-gathers and reduce-scatters
    match, and it steps its own shard of the parameters and optimizer state
    with the reduced gradient), and shadows every collective Lightning
    issues in the loop (``self.log(..., sync_dist=True)``,
    ``reduce_boolean_decision``, torchmetrics syncs). Its step-interval
    learning-rate schedulers step with the replayed steps, and epoch-interval
    ones after the last rank's last batch, so every shard is updated with the
    same learning rate. When the last rank is done, every rank takes its
    scheduler states, optimizer hyperparameters and step counters.

    The model is sharded over a one-dimensional mesh of every rank, whose
    process group is the default one (that of Lightning's collectives):
    ``self.device_mesh`` in ``configure_model()`` is that mesh, and
    ``self.device_mesh["data_parallel"]`` too. Shard the model as one root
    whose forward ``training_step`` (and, with ``exact_eval``,
    ``validation_step`` and ``test_step``) calls once per step::

        def configure_model(self):
            for layer in self.net:
                fully_shard(layer, mesh=self.device_mesh)
            fully_shard(self.net, mesh=self.device_mesh)

    The model must accept a batch of size 0 (a joined rank replays its last
    batch cut to length 0), with one optimizer and no gradient accumulation.
    Gradient clipping (``Trainer(gradient_clip_val=...)``, by norm or value,
    or ``self.clip_gradients()``) goes through
    :meth:`ddp_join.FSDPJoinable.clip_grad_norm_` and ``clip_grad_value_``,
    which a joined rank repeats with its shard of the averaged gradient: the
    model is the one a single process gets by clipping that gradient.

    Each rank brings its own share of the data: use
    ``Trainer(use_distributed_sampler=False)`` and, for example,
    :class:`ddp_join.UnevenDistributedSampler` in the train dataloader.

    Args:
        data_parallel_size: ``"auto"`` or the world size: every rank holds a
            shard (data parallelism across all ranks).
        tensor_parallel_size: ``"auto"`` or 1: tensor parallelism is not
            supported (a joined rank cannot replay it).
        save_distributed_checkpoint, process_group_backend, timeout: as
            :class:`~lightning.pytorch.strategies.ModelParallelStrategy`'s.
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

    Example::

        trainer = Trainer(
            strategy=JoinFSDPStrategy(exact_eval=True),
            use_distributed_sampler=False,
            accelerator="cpu",
            devices=2,
        )

    Raises:
        ValueError: ``tensor_parallel_size`` is not 1 or ``"auto"``; at
            set-up, ``data_parallel_size`` is not the world size, or the
            model or Trainer is set up in a way a joined rank cannot replay
            (each message names the setting to change); in fitting, a manual
            ``training_step`` that does not call ``manual_backward()`` and
            the optimizer's ``step()`` once.
        RuntimeError: after an epoch in which a rank stepped its shard with
            another learning rate than the ranks still training (a scheduler
            stepped otherwise than a joined rank can follow), on every rank,
            naming the rank, the batch and the fix.
    """

    _manual_steps = 1  # a joined rank replays one optimizer step per batch of the others

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        *,
        exact_eval: bool = False,
        throw_on_early_termination: bool = False,
        divide_by_initial_world_size: bool = True,
        liveness_timeout: timedelta | None = DEFAULT_LIVENESS_TIMEOUT,
    ) -> None:
        if tensor_parallel_size not in ("auto", 1):
            raise ValueError(
                f"JoinFSDPStrategy(tensor_parallel_size={tensor_parallel_size!r}): tensor parallelism is "
                "not supported (a rank out of batches cannot replay it); set tensor_parallel_size=1 and "
                "data_parallel_size to the world size (or leave both 'auto')"
            )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_join(
            exact_eval, throw_on_early_termination, divide_by_initial_world_size, liveness_timeout
        )
        self._joinable: FSDPJoinable | None = None
        self._step_hooks: list[RemovableHandle] = []
        # The learning rates of each optimizer step of this epoch (one per param group),
        # the replayed ones included: a joined rank must step its shard with the others'.
        self._step_lrs: list[list[float]] = []
        # The index of the batch a joined rank replays, while it does (None: not shadowing).
        self._replayed_batch: int | None = None

    # Set-up and tear-down.

    @override
    def setup_environment(self) -> None:
        """As ModelParallelStrategy's, with a one-dimensional mesh of every
        rank (named ``data_parallel``) instead of a two-dimensional one."""
        from torch.distributed.device_mesh import DeviceMesh

        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        world_size = self.world_size
        if self._data_parallel_size not in ("auto", world_size):
            raise ValueError(
                f"JoinFSDPStrategy(data_parallel_size={self._data_parallel_size!r}): with "
                f"{world_size} ranks, set data_parallel_size={world_size} (the world size) and "
                "tensor_parallel_size=1, or leave both 'auto': a rank out of batches shadows the others "
                "over one fully sharded dimension"
            )
        self._data_parallel_size = world_size
        self._tensor_parallel_size = 1
        # Over the default group itself, the one Lightning's own collectives use, so
        # one ShadowCollectives shadows both (init_device_mesh may make another
        # group, as on CUDA over gloo).
        self._device_mesh = DeviceMesh.from_group(
            _world(), self.root_device.type, mesh_dim_names=("data_parallel",)
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not fitting and not self.exact_eval:
            return
        module = _sharded_root(self.lightning_module)
        if fitting:
            if len(trainer.optimizers) != 1:
                raise ValueError(
                    f"JoinFSDPStrategy: configure_optimizers() returned {len(trainer.optimizers)} "
                    "optimizers; return one (a rank out of batches replays one optimizer step per batch)"
                )
            optimizer = trainer.optimizers[0]
        else:  # evaluation replays forwards only: an optimizer that never steps
            optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        if self._joinable is not None:
            self._joinable.remove_hooks()
        try:
            self._joinable = FSDPJoinable(module, optimizer)
        except ValueError as error:
            raise ValueError(
                f"JoinFSDPStrategy: {error}: in configure_model(), pass mesh=self.device_mesh (one "
                "dimension, every rank) to fully_shard"
            ) from error
        if fitting:
            self._route_clipping()
            self._step_hooks += [
                optimizer.register_step_pre_hook(self._before_step),
                optimizer.register_step_post_hook(self._after_step),
            ]

    @override
    def _check_trainer(self, trainer: pl.Trainer) -> None:
        super()._check_trainer(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"JoinFSDPStrategy: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) "
                "is not supported (a rank out of batches replays one forward, backward and optimizer step "
                "per batch of the others); use accumulate_grad_batches=1 and a larger batch"
            )

    @override
    def teardown(self) -> None:
        self._leave_all()
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        for name in _CLIPS:
            self.precision_plugin.__dict__.pop(name, None)
        if self._joinable is not None:
            self._joinable.remove_hooks()
            self._joinable = None
        super().teardown()

    @override
    def _manual_rule(self) -> str:
        return (
            "a rank out of batches replays one forward, backward and optimizer step per batch of the "
            "others; call self.manual_backward() and opt.step() once in every training_step (for "
            "gradient accumulation, use a larger batch)"
        )

    # The joinables.

    @override
    def _training_joinables(self) -> Sequence[Joinable] | None:
        return self._joinables()

    @override
    def _evaluation_joinables(self) -> Sequence[Joinable]:
        return self._joinables()

    def _joinables(self) -> list[Joinable]:
        if self._joinable is None:
            raise RuntimeError("JoinFSDPStrategy: a Join was entered before setup() found the sharded model")
        return [self._joinable, ShadowCollectives(self._joinable.join_process_group)]

    @override
    def _take_optimizer_states(self) -> bool:
        return False  # each rank holds (and stepped) its own shard of them

    @override
    def enter_training(self) -> None:
        if self._training_join is None:
            self._step_lrs = []  # a new epoch
        super().enter_training()

    @override
    def leave_training(self, error: BaseException | None, validates: bool = False) -> bool:
        """Leave this epoch's Join: shadow the other ranks' batches (stepping
        the step-interval schedulers with the replayed optimizer steps) and
        take the scheduler states and counters of the longest rank."""
        trainer = self._trainer
        if self._training_join is not None and error is None and trainer is not None:
            self._replayed_batch = int(trainer.fit_loop.epoch_loop.batch_progress.current.completed)
        try:
            return super().leave_training(error, validates)
        finally:
            self._replayed_batch = None

    def _route_clipping(self) -> None:
        """Clip through the joinable, which a joined rank's replay repeats:
        the precision plugin's ``clip_grad_by_norm`` and ``clip_grad_by_value``
        (which ``Trainer(gradient_clip_val=...)`` and ``self.clip_gradients()``
        reach) call :meth:`ddp_join.FSDPJoinable.clip_grad_norm_` and
        ``clip_grad_value_`` instead of torch's. torch's norm is totalled by a
        DTensor all-reduce that a joined rank would not issue; the joinable's
        counts the joined rank's shard of the reduced gradient, so the norm is
        that of the whole averaged gradient, as with DDP."""
        strategy = self

        def clip_grad_by_norm(optimizer: object, clip_val: float) -> None:
            assert strategy._joinable is not None, "set up with the joinable"
            strategy._joinable.clip_grad_norm_(float(clip_val))

        def clip_grad_by_value(optimizer: object, clip_val: float) -> None:
            assert strategy._joinable is not None, "set up with the joinable"
            strategy._joinable.clip_grad_value_(float(clip_val))

        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = clip_grad_by_value  # type: ignore[method-assign]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._step_lrs.append([float(group["lr"]) for group in optimizer.param_groups])

    @override
    def _epoch_record(self) -> Any:
        return self._step_lrs

    @override
    def _check_epoch_record(self, record: Any, src: int) -> None:
        """Every rank checks that each of its optimizer steps of the epoch,
        the replayed ones included, had the learning rates of rank ``src``'s
        step of the same batch; if one did not, every rank raises."""
        found = torch.zeros(self.world_size, 3, dtype=torch.float64, device=self.root_device)
        for batch, (mine, theirs) in enumerate(zip(self._step_lrs, record)):
            differ = [(a, b) for a, b in zip(mine, theirs) if not math.isclose(a, b, rel_tol=1e-6)]
            if differ:
                found[self.global_rank] = torch.tensor([batch + 1, *differ[0]], dtype=torch.float64)
                break
        dist.all_reduce(found)
        ranks = [rank for rank in range(self.world_size) if found[rank, 0] > 0]
        if not ranks:
            return
        batch, mine, theirs = found[ranks[0]].tolist()
        others = ""
        if len(ranks) > 1:
            others = f" (rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))} too)"
        epoch = self._trainer.current_epoch if self._trainer is not None else "?"
        raise RuntimeError(
            f"JoinFSDPStrategy: rank {ranks[0]} stepped its shard at batch {int(batch) - 1} of epoch "
            f"{epoch} with learning rate {mine:g} where rank {src}, still training, used {theirs:g}"
            f"{others}, so the model is no longer the one every rank would train: a rank out of "
            'batches steps only the schedulers configured with "interval": "step", once per replayed '
            "optimizer step. Step a scheduler either once after every optimizer step, configured with "
            '"interval": "step" (with manual optimization, in training_step), or after the epoch (in '
            "on_train_epoch_end, not on trainer.is_last_batch, which comes earlier on a rank with fewer "
            "batches); a ReduceLROnPlateau on a step interval cannot lower the learning rate while a "
            "rank is out of batches"
        )

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After a joined rank's replayed optimizer step: step the
        step-interval schedulers as Lightning does after that batch on the
        ranks still training."""
        if self._replayed_batch is None or self._trainer is None:
            return
        batch = self._replayed_batch
        self._replayed_batch += 1
        for config in self._trainer.lr_scheduler_configs:
            if (
                config.interval == "step"
                and not config.reduce_on_plateau
                and (batch + 1) % config.frequency == 0
            ):
                self.lightning_module.lr_scheduler_step(config.scheduler, None)  # type: ignore[union-attr]


#: The precision plugin's methods that clip through the joinable (instance attributes while set up).
_CLIPS: Final = ("clip_grad_by_norm", "clip_grad_by_value")


def _sharded_root(module: torch.nn.Module | None) -> torch.nn.Module:
    """The one outermost module sharded with ``fully_shard``."""
    assert module is not None
    roots: list[tuple[str, FSDPModule]] = []
    covered: list[str] = []
    for name, child in module.named_modules():
        if not isinstance(child, FSDPModule):
            continue
        if any(name == c or name.startswith(c + ".") or c == "" for c in covered):
            continue
        covered.append(name)
        roots.append((name or "self", child))
    if len(roots) == 1:
        root = roots[0][1]
        assert isinstance(root, torch.nn.Module)
        return root
    found = ", ".join(name for name, _ in roots) if roots else "none"
    raise ValueError(
        f"JoinFSDPStrategy: the LightningModule has {len(roots)} outermost modules sharded with "
        f"fully_shard ({found}); a rank out of batches replays the forward of one: in configure_model(), "
        "shard the layers, then the module that holds them all (e.g. fully_shard(self.net, "
        "mesh=self.device_mesh)), and call its forward once per step"
    )


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None, "setup_environment() initializes the default process group first"
    return group
