"""The Joinable of an evaluation loop: one heartbeat per step, nothing else."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from join_core import Join, JoinHook

__all__ = ["EvaluationSteps"]


class EvaluationSteps:
    """The first joinable of a Join around evaluation (or any loop without a
    gradient synchronization): a model that only runs forward issues no
    heartbeat of its own, so this one does, once per step.

    Call :meth:`step` at the start of each step; put
    :class:`join_core.ShadowCollectives` after it so that a rank out of
    batches shadows the steps' metric syncs::

        steps = EvaluationSteps()
        with Join([steps, ShadowCollectives()]):
            for x, y in my_batches:  # fewer on some ranks
                steps.step()
                metric(model(x), y)  # may sync on every step

    Args:
        device: the device of the heartbeat (default: CPU, or the current
            CUDA device when the group's backend is NCCL).
        process_group: the group of the loop's collectives (default: the world).
    """

    def __init__(
        self, device: torch.device | None = None, process_group: dist.ProcessGroup | None = None
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "EvaluationSteps: the default process group is not initialized; "
                "call torch.distributed.init_process_group() first"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None
        self._group: dist.ProcessGroup = group
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._device = device

    def step(self) -> None:
        """Tell the Join this rank has one more step (the heartbeat)."""
        Join.notify_join_context(self)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A hook with nothing to shadow: Join's own heartbeat is the step's."""
        return JoinHook()

    @property
    def join_device(self) -> torch.device:
        """The device of the heartbeat."""
        return self._device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group whose steps are counted."""
        return self._group
