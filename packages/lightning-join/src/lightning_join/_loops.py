"""Where Lightning's loops begin and end a rank's batches: a Join brackets them.

Lightning calls no strategy hook at the moments that matter: after a rank's
last training batch (before the epoch-end validation), and after its last
evaluation batch (before the epoch's metrics are computed and synced). So
these methods of the loop *instances* of one Trainer are wrapped while the
strategy runs it, and put back at teardown:

- training epoch loop: ``advance`` (enters the epoch's Join before the first
  batch), ``on_advance_end`` (leaves it after the rank's last batch, before
  validation), ``run`` (leaves it however the batches end), and
  ``_broadcast_sigterm_tensor``. That one broadcasts rank 0's SIGTERM flag
  before each batch: no rank can shadow a broadcast from rank 0 once rank 0
  has joined, and a joined rank replays only what follows its last batch's
  forward. An all-reduce (MAX) of the flags after each batch replaces it, so
  any rank's SIGTERM stops every rank, one batch boundary later than before
  at the most. And ``update_lr_schedulers``: Lightning steps the
  epoch-interval schedulers at a rank's last batch, which is earlier on a
  rank with fewer batches; inside the Join that step waits until the rank
  has left it (and taken the longest rank's scheduler states), so every
  rank's optimizer steps with the same learning rate until the epoch ends.
  And ``_should_check_val_fx``: Lightning decides at each rank's last batch
  whether to validate: a rank out of batches would, the longest, stopped by
  ``max_steps`` before its last batch, would not. The ranks agree as they
  leave the Join, validating only if every rank would.
- evaluation loops: ``run`` (an error leaves the Join),
  ``_store_dataloader_outputs`` (the end of a dataloader's batches: the Join
  is left before the metrics are synced) and ``on_run_end``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["LoopHooks", "unwrap", "wrap_evaluation_loop", "wrap_training_epoch_loop"]


class LoopHooks(Protocol):
    """What the strategy does at the loops' moments."""

    def enter_training(self) -> None: ...
    def leave_training(self, error: BaseException | None, validates: bool = False) -> bool: ...
    def training_done(self) -> bool: ...
    def leave_evaluation(self, error: BaseException | None) -> None: ...
    def in_training_join(self) -> bool: ...
    @property
    def root_device(self) -> torch.device: ...
    def received_sigterm(self) -> bool: ...


_WRAPPED = "_lightning_join_wrapped"


def _set(loop: object, name: str, method: Callable[..., Any]) -> None:
    setattr(loop, name, method)
    wrapped: list[str] = loop.__dict__.setdefault(_WRAPPED, [])
    wrapped.append(name)


def unwrap(loop: object) -> None:
    """Put back the loop's own methods."""
    for name in loop.__dict__.pop(_WRAPPED, []):
        loop.__dict__.pop(name, None)


def wrap_training_epoch_loop(loop: Any, hooks: LoopHooks) -> None:
    """Bracket the training batches of each epoch of ``loop`` with the strategy's Join."""
    if _WRAPPED in loop.__dict__:
        return
    run, advance, on_advance_end = loop.run, loop.advance, loop.on_advance_end
    update_lr_schedulers = loop.update_lr_schedulers
    should_check_val = loop._should_check_val_fx
    deferred: list[tuple[Any, ...]] = []  # epoch-interval scheduler updates, until the Join is left
    agreed: list[bool] = []  # whether every rank validates after the batch that left the Join

    def leave(error: BaseException | None, validates: bool = False) -> bool:
        every_rank_validates = hooks.leave_training(error, validates)
        if error is None:
            for args in deferred:
                update_lr_schedulers(*args)
        deferred.clear()
        return every_rank_validates

    @functools.wraps(run)
    def run_wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = run(*args, **kwargs)
        except BaseException as error:
            leave(error)
            raise
        leave(None)
        return result

    @functools.wraps(advance)
    def advance_wrapper(*args: Any, **kwargs: Any) -> Any:
        hooks.enter_training()
        try:
            return advance(*args, **kwargs)
        except StopIteration:
            leave(None)  # the batches ran out before a step
            raise

    @functools.wraps(update_lr_schedulers)
    def update_lr_schedulers_wrapper(interval: str, update_plateau_schedulers: bool) -> None:
        if interval == "epoch" and hooks.in_training_join():
            deferred.append((interval, update_plateau_schedulers))
            return
        update_lr_schedulers(interval, update_plateau_schedulers)

    @functools.wraps(on_advance_end)
    def on_advance_end_wrapper(*args: Any, **kwargs: Any) -> Any:
        if dist.is_initialized() and dist.get_world_size() > 1:
            agree_on_sigterm()
        if hooks.training_done():
            agreed.append(leave(None, validates=bool(should_check_val(*args, **kwargs))))
        try:
            return on_advance_end(*args, **kwargs)
        finally:
            agreed.clear()

    @functools.wraps(should_check_val)
    def should_check_val_wrapper(*args: Any, **kwargs: Any) -> bool:
        return agreed.pop() if agreed else bool(should_check_val(*args, **kwargs))

    def agree_on_sigterm() -> None:
        flag = torch.tensor([1.0 if hooks.received_sigterm() else 0.0], device=hooks.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            raise SIGTERMException()

    def no_broadcast() -> None:
        """Lightning's check before each batch, done by agree_on_sigterm after it instead."""

    _set(loop, "run", run_wrapper)
    _set(loop, "advance", advance_wrapper)
    _set(loop, "on_advance_end", on_advance_end_wrapper)
    _set(loop, "update_lr_schedulers", update_lr_schedulers_wrapper)
    _set(loop, "_should_check_val_fx", should_check_val_wrapper)
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        _set(loop, "_broadcast_sigterm_tensor", no_broadcast)


def wrap_evaluation_loop(loop: Any, hooks: LoopHooks) -> None:
    """Leave the evaluation Join of ``loop`` when a rank's batches of a dataloader end."""
    if _WRAPPED in loop.__dict__:
        return
    run, store, on_run_end = loop.run, loop._store_dataloader_outputs, loop.on_run_end

    @functools.wraps(run)
    def run_wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except BaseException as error:
            hooks.leave_evaluation(error)
            raise

    @functools.wraps(store)
    def store_wrapper(*args: Any, **kwargs: Any) -> Any:
        hooks.leave_evaluation(None)
        return store(*args, **kwargs)

    @functools.wraps(on_run_end)
    def on_run_end_wrapper(*args: Any, **kwargs: Any) -> Any:
        hooks.leave_evaluation(None)
        return on_run_end(*args, **kwargs)

    _set(loop, "run", run_wrapper)
    _set(loop, "_store_dataloader_outputs", store_wrapper)
    _set(loop, "on_run_end", on_run_end_wrapper)
