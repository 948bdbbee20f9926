"""The hooks a Joinable gives the Join context manager."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from join_core.regroup import Recovery

__all__ = ["JoinHook"]


class JoinHook:
    """Entry points that let a joined rank keep step with the ranks still training.

    Subclass it and override what the joinable needs; every method is a no-op
    here.

    - :meth:`main_hook` runs once per iteration of the ranks that have not
      joined, on every rank that has: it issues the same collectives, in the
      same order, as one iteration of the joinable does.
    - :meth:`post_hook` runs once, after every rank has joined.
    - :meth:`abort_hook` runs on a rank that leaves the context with an
      exception, before it tells the others: it issues the collectives the
      joinable still owes for an iteration it began and did not finish.
    - :meth:`enter_hook` and :meth:`exit_hook` bracket the context, for a
      joinable whose state lives exactly as long as it.
    - :meth:`regroup_hook` moves the joinable onto the survivors' process
      group after a rank was lost (``Join(on_rank_lost="continue")``); a hook
      that does not override it makes such a Join refuse to start.

    A hook whose joinable carries Join's heartbeat in its own first
    per-iteration all-reduce sets :attr:`carries_heartbeat` (see
    :class:`join_core.Joinable` for that contract).
    """

    #: True if this hook's joinable carries the heartbeat in its own first
    #: all-reduce of each iteration instead of Join issuing one of its own.
    carries_heartbeat: bool = False

    #: How many stages of collectives one iteration of this joinable has (e.g.
    #: a broadcast, then a reduction): the ``phase`` it gives
    #: :meth:`join_core.Join.recover` is one of ``range(regroup_phases)``.
    regroup_phases: int = 1

    def main_hook(self) -> None:
        """Shadow one iteration of the joinable's collectives on a joined rank."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Run once after all ranks have joined.

        Args:
            is_last_joiner: True on the ranks that joined in the last iteration.
        """

    def abort_hook(self) -> None:
        """Finish the collectives of an interrupted iteration on a failing rank.

        Called once, in joinable order, on a rank whose body raised inside the
        context, so that the ranks still training are not left waiting on a
        collective this rank never issued. A joinable that was between
        iterations has nothing to issue.
        """

    def enter_hook(self) -> None:
        """Run when the Join is entered, before its body (only if enabled)."""

    def exit_hook(self) -> None:
        """Run when the Join is left, however it is left: undo :meth:`enter_hook`.

        Runs after :meth:`post_hook` or the abort, in reverse joinable order,
        on every hook whose :meth:`enter_hook` returned.
        """

    def regroup_hook(self, recovery: Recovery, first_phase: int) -> None:
        """Move the joinable onto ``recovery.group``, the process group of the
        ranks that survived a loss, from which every later collective is issued.

        Called on every surviving rank, in joinable order, once the survivors
        agreed on who is lost and where each was (see
        :meth:`join_core.Join.recover`). A survivor that finished a stage the
        others did not hands them its result here, with collectives on the
        new group that every survivor issues in the same order
        (``recovery.completed(position, first_phase + phase)`` says how often
        a survivor finished this joinable's stage ``phase``). The collective
        that failed is then completed by the joinable that issued it.

        Raises:
            NotImplementedError: here; a joinable that can go on without the
                lost ranks overrides it.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot move onto the survivors' process group")
