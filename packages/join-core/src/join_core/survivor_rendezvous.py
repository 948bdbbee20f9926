"""A rendezvous handler under which no node joins a running job."""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

# SurvivorRendezvous is public as join_core.survivor_agent's.
__all__: list[str] = []

# Logged under the agent's name, as before this handler had a module of its own.
logger: logging.Logger = logging.getLogger("join_core.survivor_agent")


class SurvivorRendezvous(RendezvousHandler):
    """A rendezvous handler that never reports nodes waiting to join, so that
    the agent does not stop its running workers to admit them (torch's agent
    restarts every worker when a node waits); everything else is ``inner``'s."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner
        self._told = False

    def get_backend(self) -> str:
        """``inner``'s."""
        return str(self._inner.get_backend())

    @property
    def use_agent_store(self) -> bool:
        """``inner``'s."""
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> RendezvousInfo:
        """``inner``'s."""
        return self._inner.next_rendezvous()

    def is_closed(self) -> bool:
        """``inner``'s."""
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        """``inner``'s."""
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """0, whatever ``inner`` says (logged once when it says more)."""
        waiting = int(self._inner.num_nodes_waiting())
        if waiting and not self._told:
            self._told = True
            logger.warning(
                "join_core.launch: %d node(s) wait to join the rendezvous; they are not admitted: the "
                "running workers go on, and the group is never re-formed",
                waiting,
            )
        return 0

    def get_run_id(self) -> str:
        """``inner``'s."""
        return str(self._inner.get_run_id())

    def shutdown(self) -> bool:
        """``inner``'s."""
        return bool(self._inner.shutdown())
