"""The Joinable protocol: what the Join context manager needs of a participant."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Protocol, runtime_checkable

from join_core.hook import JoinHook

__all__ = ["Joinable"]


@runtime_checkable
class Joinable(Protocol):
    """A participant of :class:`join_core.Join`: something that issues collectives
    every iteration and can shadow them once its rank runs out of inputs.

    Implement the three members below; subclassing this Protocol explicitly
    (and calling ``super().__init__()``) works too. No other state is required.

    Every iteration, before its first collective, a joinable calls
    :meth:`join_core.Join.notify_join_context` with itself. The first joinable
    of an enabled Join then sends the heartbeat: a count of the ranks that
    have not joined, which joined ranks read to know whether to shadow.

    **Carrying the heartbeat** (no extra collective per iteration): a joinable
    whose every iteration starts with an all-reduce (SUM) of a floating-point
    buffer may reserve one element of that buffer for the heartbeat, and set
    ``carries_heartbeat = True`` on the hook it returns. Then Join issues no
    all-reduce of its own, and the joinable must, on every iteration and in
    every hook:

    1. fill the slot with ``Join.heartbeat_signal(self)`` before the all-reduce
       (1 on a training rank, 0 on a joined one, a negative value on a failing
       one);
    2. pass the reduced slot to ``Join.heartbeat_result(self, total)``. While
       training, call it once all of the iteration's collectives of this
       joinable have completed: it raises if another rank failed or, with
       ``throw_on_early_termination``, joined. In :meth:`JoinHook.main_hook`,
       call it once the carrying all-reduce completed: when it returns False
       every rank has joined and is in this same hook, so the hook may stop
       there or finish the iteration, as long as every rank does the same.
    """

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Return the hook that shadows this joinable's collectives.

        Args:
            kwargs: the keyword arguments given to :class:`join_core.Join`,
                the same for every joinable of one context.
        """
        ...

    @property
    def join_device(self) -> torch.device:
        """The device of the tensors Join uses for its own collectives."""
        ...

    @property
    def join_process_group(self) -> Any:
        """The process group of this joinable's collectives, and of Join's: a
        ``torch.distributed.ProcessGroup``, or None for the default group.

        Typed ``Any`` as torch's ``Joinable`` types it, so that a joinable
        written for torch's Join (returning ``dist.group.WORLD``, a
        ``ProcessGroup | None``) satisfies this Protocol unchanged.
        """
        ...
