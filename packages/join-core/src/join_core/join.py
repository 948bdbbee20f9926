"""The Join context manager: training with uneven inputs across ranks."""

from __future__ import annotations

import enum
import logging
import threading
import warnings
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, Literal

import torch
import torch.distributed as dist
from typing_extensions import Self

from join_core.collective_watch import DEFAULT_HANG_TIMEOUT, CollectiveDesyncError
from join_core.exit_grace import install_exit_grace
from join_core.hook import JoinHook
from join_core.joinable import Joinable
from join_core.liveness import DEFAULT_LIVENESS_TIMEOUT, LivenessWatchdog, RankLostError, check_watch_timeouts
from join_core.recorder import record_collectives
from join_core.regroup import RankRemovedError, Recovery, agree, build_group, removed_at

__all__ = ["Join", "JoinAbortedError"]

logger: logging.Logger = logging.getLogger(__name__)

#: Shadowed iterations after which Join warns once that the skew is large.
SKEW_WARN_THRESHOLD: Final = 1000
#: How long the ranks wait for one another while agreeing on an abort.
ABORT_TIMEOUT: Final = timedelta(seconds=30)
#: Bytes of each rank's failure message exchanged on abort.
_REASON_BYTES: Final = 1024

_ON_RANK_LOST: Final = ("raise", "continue")
#: How often a survivor looks for the others' arrival in the agreement.
_AGREEMENT_POLL_S: Final = 0.02

#: Why the survivors cannot go on when the rank serving the store is lost, and the fix.
_STORE_HOST_FIX: Final = (
    "launch with `python -m join_core.launch` (torchrun's arguments), whose agent serves the store "
    "(TORCHELASTIC_USE_AGENT_STORE=True), not with MASTER_ADDR/MASTER_PORT pointing at rank {rank}"
)
_STORE_HOST_WARNING: Final = (
    "Join(on_rank_lost='continue'): this process (rank {rank}) serves the process group's store, so if it "
    "is lost the store is lost with it and no rank can go on; " + _STORE_HOST_FIX
)
_STORE_HOST_LOST: Final = (
    "rank {rank}'s process served the process group's store, lost with it, so the survivors cannot agree "
    "on going on; " + _STORE_HOST_FIX
)

_ACTIVE_SIGNAL: Final = 1.0
_JOINED_SIGNAL: Final = 0.0


class JoinAbortedError(RuntimeError):
    """Raised on every rank of a Join when another rank failed inside it.

    Attributes:
        failures: the failing ranks, each with its exception's type and message.
    """

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        detail = "; ".join(f"rank {rank} raised {reason}" for rank, reason in sorted(failures.items()))
        super().__init__(f"Join aborted: {detail}")


class _State(enum.Enum):
    TRAINING = enum.auto()
    JOINED = enum.auto()
    ABORTING = enum.auto()


_registry_lock = threading.Lock()
# id(joinable) -> (joinable, its Join, is it the first joinable); entries live
# while the Join is entered, so no state is stored on the joinables.
_registry: dict[int, tuple[Joinable, Join, bool]] = {}


def _lookup(joinable: Joinable) -> tuple[Join, bool] | None:
    entry = _registry.get(id(joinable))
    if entry is None or entry[0] is not joinable:
        return None
    return entry[1], entry[2]


class Join:
    """Context manager that lets ranks with fewer inputs join early.

    Inside the context every rank runs its training loop over its own inputs.
    A rank that runs out leaves the ``with`` body and, on exit, shadows the
    collectives of the ranks still training (through each joinable's
    :class:`JoinHook`) until all have joined; then every hook's ``post_hook``
    runs. If a rank raises inside the body, every rank leaves the context with
    an exception: the failing rank with its own, the others with
    :class:`JoinAbortedError` naming it.

    Args:
        joinables: the participants, in the order their hooks run; they share
            one process group, and the first one's device is used.
        enable: False turns all join logic off (for inputs known to be even).
        throw_on_early_termination: raise on every rank as soon as one rank
            runs out of inputs, instead of shadowing.
        liveness_timeout: a rank that sends no heartbeat through the store
            for this long (it died, froze or was cut off) is lost: every
            other rank raises :class:`RankLostError` naming it, at most
            ``liveness_timeout * 1.2`` plus a moment after the loss. None
            turns the watch off (then only the process group's timeout ends
            a wait on a frozen rank), and with it the two below.
        hang_timeout: a collective on the group waiting longer than this
            (and than 20 times its median time) makes every rank log a hang
            report whose first line names the culprit ("rank 2 never entered
            all_reduce #41 ...: it is in train.py:57 load_batch()") and write
            its dump; the wait goes on. None: no hang reports. Ranks that
            enter different collectives at the same sequence number raise
            :class:`CollectiveDesyncError` within about two heartbeats
            whatever this is.
        on_rank_lost: ``"raise"``: a lost rank makes every other rank raise
            :class:`RankLostError`. ``"continue"``: the survivors agree on who
            is lost, build a process group of their own (:attr:`process_group`),
            move every joinable onto it (:meth:`JoinHook.regroup_hook`) and
            go on: the lost rank counts as a rank that joined for good. The
            collective that failed is completed by its joinable without the
            lost ranks' part in it, or raises :class:`RankLostError` saying
            why it cannot be. A rank that was declared lost and comes back
            raises :class:`join_core.RankRemovedError`. Needs the liveness
            watch, joinables that support it (DistributedDataParallel), and
            a store that outlives every rank: launch with
            ``python -m join_core.launch`` (:mod:`join_core.launch`).
        kwargs: passed to every joinable's ``join_hook``.

    Example::

        with Join([model, optimizer]):
            for batch in my_batches:  # may be fewer on some ranks
                model(batch).sum().backward()
                optimizer.step()
    """

    def __init__(
        self,
        joinables: list[Joinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        *,
        liveness_timeout: timedelta | None = DEFAULT_LIVENESS_TIMEOUT,
        hang_timeout: timedelta | None = DEFAULT_HANG_TIMEOUT,
        on_rank_lost: Literal["raise", "continue"] = "raise",
        **kwargs: Any,
    ) -> None:
        given: object = joinables  # callers without type checking pass anything
        if not isinstance(given, (list, tuple)):
            hint = "Join([model])" if isinstance(given, Joinable) else "Join([model, optimizer])"
            raise TypeError(
                f"Join(joinables={given!r:.80}): expected a list of Joinables, "
                f"got {type(given).__name__}; pass them in a list, e.g. {hint}"
            )
        if len(joinables) == 0:
            raise ValueError("Join(joinables=[]): the join context manager requires at least one joinable")
        for index, joinable in enumerate(joinables):
            if not isinstance(joinable, Joinable):
                raise TypeError(
                    f"Join(joinables[{index}]={type(joinable).__name__}): not a Joinable; "
                    "implement join_hook(), join_device and join_process_group"
                )
        self._joinables = list(joinables)
        self._hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self._enable = enable
        self._throw_on_early_termination = throw_on_early_termination
        # None (torch's joinables may return dist.group.WORLD, typed Optional): the default group.
        groups = [_group_of(joinable) for joinable in self._joinables]
        if any(group != groups[0] for group in groups[1:]):
            raise ValueError("Using join context manager with multiple process groups")
        self._group: dist.ProcessGroup = groups[0]
        self._device = self._joinables[0].join_device
        self._rank = dist.get_rank(self._group)
        self._world_size = dist.get_world_size(self._group)
        self._fused = self._hooks[0].carries_heartbeat
        self._state = _State.TRAINING
        self._last_total: float | None = None  # the latest heartbeat seen by this rank
        self._reported = 0  # heartbeats seen so far
        self._iterations = 0  # notify_join_context calls of the first joinable
        self._entered_hooks: list[JoinHook] = []
        self._done = False  # an early termination or abort was already agreed on
        # Set when this rank gives up going on without a lost rank: the other survivors may
        # still be recovering, so it leaves as a failed rank (they then name it, not wait).
        self._gave_up: BaseException | None = None
        self._entered = False
        check_watch_timeouts("Join", liveness_timeout, hang_timeout)
        self._liveness_timeout = liveness_timeout
        self._hang_timeout = hang_timeout
        self._liveness: LivenessWatchdog | None = None
        self._on_rank_lost = _check_on_rank_lost(on_rank_lost, liveness_timeout, self._joinables, self._hooks)
        self._members = _global_ranks(self._group)  # global rank of each rank of the current group
        self._lost: dict[int, str] = {}  # global rank -> what was seen, and when it was removed
        self._contributions: dict[int, int] = {}  # lost global rank -> heartbeats it took part in
        self._regroup_prefix = ""  # the first watch's, under which every agreement of this Join is kept
        self._period = sum(hook.regroup_phases for hook in self._hooks)  # stages of one iteration
        record_collectives()
        install_exit_grace()

    def __enter__(self) -> Self:
        if self._entered:
            raise RuntimeError("Join: this context was already entered; create a new Join")
        self._entered = True
        if not self._enable:
            return self
        self._fused = self._hooks[0].carries_heartbeat  # a joinable may change it until now
        if self._on_rank_lost == "continue" and not self._fused and self._world_size > 1:
            raise ValueError(
                f"Join(on_rank_lost='continue'): {type(self._joinables[0]).__name__}, the first joinable, "
                "must carry the heartbeat in its own all-reduce (DistributedDataParallel does, with its "
                "built-in reduction and float32 or float64 gradients); put such a joinable first, or "
                "use on_rank_lost='raise'"
            )
        with _registry_lock:
            for joinable in self._joinables:
                entry = _lookup(joinable)
                if entry is not None:
                    raise RuntimeError(
                        f"Join: {type(joinable).__name__} is already inside another Join; "
                        "leave that context before entering this one"
                    )
            for index, joinable in enumerate(self._joinables):
                _registry[id(joinable)] = (joinable, self, index == 0)
        try:
            for hook in self._hooks:
                hook.enter_hook()
                self._entered_hooks.append(hook)
            if self._liveness_timeout is not None and self._world_size > 1:
                self._liveness = self._start_watch(self._group)
                self._regroup_prefix = f"{self._liveness.prefix}regroup/"
                if self._on_rank_lost == "continue" and self._liveness.hosts_store:
                    warnings.warn(_STORE_HOST_WARNING.format(rank=self._rank), RuntimeWarning, stacklevel=2)
        except BaseException:
            self._leave()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._enable:
            return
        # Set when this rank leaves raising what the others were not told through the
        # abort: its liveness watch says so, and theirs then judge it lost, naming it.
        untold: BaseException | None = None
        try:
            if exc is None:
                self._state = _State.JOINED
                try:
                    self._shadow_until_all_joined()
                except BaseException as failure:
                    if isinstance(failure, Exception):
                        self._raise_if_rank_lost(failure)
                    if not (
                        self._done  # an early termination or an abort: every rank raises
                        or _raised_on_every_rank(failure)
                        or isinstance(failure, (RankLostError, CollectiveDesyncError))  # a verdict
                    ):
                        untold = failure  # the others wait in collectives it shadowed
                    raise
            elif self._raise_if_rank_lost(exc):
                pass
            elif (
                not self._done
                and not _raised_on_every_rank(exc)
                # A DistError: the process group may be what failed, so no abort collective.
                # A KeyboardInterrupt or SystemExit is news for the others just as an
                # Exception is; this rank re-raises its own all the same.
                and (isinstance(exc, dist.DistError) or not self._abort(exc))
            ):
                untold = exc
        finally:
            self._leave(untold)

    def _leave(self, untold: BaseException | None = None) -> None:
        untold = untold or self._gave_up
        try:
            if self._liveness is not None:
                self._liveness.stop(None if untold is None else _describe_failure(untold))
            while self._entered_hooks:
                self._entered_hooks.pop().exit_hook()
        finally:
            with _registry_lock:
                for joinable in self._joinables:
                    if _lookup(joinable) is not None:
                        del _registry[id(joinable)]

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The process group the Join and its joinables use now: the joinables'
        own until a rank is lost, then the survivors' (``on_rank_lost="continue"``).

        ``torch.distributed``'s default group, ranks and world size stay those
        of the start; after a loss the default group cannot complete a
        collective any more: issue your own collectives on this group, with
        ``dist.get_rank(join.process_group)`` as the rank."""
        return self._group

    @property
    def lost_ranks(self) -> dict[int, str]:
        """Global rank -> what was seen, of each rank lost so far and gone on without."""
        return dict(self._lost)

    @property
    def contributions(self) -> dict[int, int]:
        """Lost global rank -> how many of the Join's iterations (heartbeats) it
        took part in: the survivors' gradients hold its part of exactly those."""
        return dict(self._contributions)

    @staticmethod
    def companions(joinable: Joinable) -> tuple[Joinable, ...]:
        """The other joinables of the entered Join ``joinable`` is in, in their
        order (empty outside one): what else a joined rank's shadowing may
        serve, e.g. an optimizer that reads the gradients a model's hook writes."""
        found = _lookup(joinable)
        if found is None:
            return ()
        return tuple(other for other in found[0]._joinables if other is not joinable)

    @staticmethod
    def continues_on_loss(joinable: Joinable) -> bool:
        """Whether ``joinable`` is inside an entered Join with ``on_rank_lost="continue"``:
        it then keeps what it needs to redo a collective without a lost rank's part."""
        found = _lookup(joinable)
        if found is None or not found[0]._enable:
            return False
        join = found[0]
        return join._on_rank_lost == "continue" and join._world_size > 1

    @staticmethod
    def recover(joinable: Joinable, iteration: int, phase: int, failure: BaseException) -> Recovery:
        """Called by ``joinable`` when one of its collectives failed: go on
        without the lost ranks, or raise.

        With ``on_rank_lost="continue"`` and a rank lost, the survivors agree
        on who is lost and where each of them was (``iteration``: how many of
        its iterations this joinable finished since this Join was entered,
        counted alike by every joinable of the Join; ``phase``: which of its
        ``regroup_phases`` stages failed), build their process group and move
        every joinable onto it (:meth:`JoinHook.regroup_hook`, this one's
        included). Returns what was agreed; the joinable then completes its
        failed collective on ``Recovery.group``.

        Raises:
            RankLostError: ``on_rank_lost="raise"``, or the survivors cannot go on.
            RankRemovedError: this rank was declared lost by the others.
            CollectiveDesyncError: the failure came from a desync, not a loss.
            BaseException: ``failure`` itself, when no rank was lost.
        """
        found = _lookup(joinable)
        if found is None:
            raise failure
        join = found[0]
        index = next(i for i, known in enumerate(join._joinables) if known is joinable)
        phases = join._hooks[index].regroup_phases
        if not 0 <= phase < phases:
            raise ValueError(f"Join.recover(phase={phase}): out of range for {phases} regroup_phases")
        first = sum(hook.regroup_phases for hook in join._hooks[:index])
        return join._recover(iteration * join._period + first + phase, failure)

    def _recover(self, position: int, failure: BaseException) -> Recovery:
        watch = self._liveness
        if watch is None:
            raise failure
        if not isinstance(failure, (RankLostError, CollectiveDesyncError)) and not _is_communication_failure(
            failure
        ):
            raise failure
        if self._on_rank_lost == "continue":
            watch.judge_closed_connection(failure)  # a process that ended is lost at once
        verdict = failure if isinstance(failure, RankLostError) else watch.wait_for_failure()
        if self._on_rank_lost == "continue" and isinstance(verdict, RankLostError):
            store_host = watch.lost_store_host()
            if store_host is not None:
                detail = _STORE_HOST_LOST.format(rank=self._members[store_host])
                raise RankLostError(verdict.ranks, detail) from failure
        published = watch.published_verdict() if self._on_rank_lost == "continue" else {}
        if watch.rank in published:
            me = self._members[watch.rank]
            # Where the survivors recorded their agreement: under every rank lost so far.
            lost_key = _lost_key(set(self._lost) | {self._members[rank] for rank in published})
            raise RankRemovedError(
                me, removed_at(watch.store(), f"{self._regroup_prefix}{lost_key}/"), "its heartbeat stopped"
            ) from failure
        if verdict is None:
            raise failure
        if not isinstance(verdict, RankLostError) or self._on_rank_lost != "continue":
            raise verdict from failure
        stuck = _cannot_go_on(self._joinables, self._hooks)
        if stuck:
            raise RankLostError(verdict.ranks, detail=self._stuck_detail(stuck)) from failure
        watch.release_group()  # survivors blocked on this one in the old group fail now, and join in
        newly = {self._members[rank]: seen for rank, seen in verdict.ranks.items()}
        lost = {**self._lost, **newly}
        expected = [rank for rank in self._members if rank not in lost]
        me = self._members[self._rank]
        watched = {member: index for index, member in enumerate(self._members)}
        assert self._liveness_timeout is not None  # a watch runs
        prefix = f"{self._regroup_prefix}{_lost_key(set(lost))}/"
        agreement = agree(
            watch.store(),
            prefix,
            me,
            expected,
            position,
            self._iterations,
            self._reported,
            lambda rank: watch.quiet_for(watched[rank]),
            self._liveness_timeout,
            _AGREEMENT_POLL_S,
            departed=lambda rank: watch.departed(watched[rank]),
        )
        for rank in expected:
            if rank not in agreement.members:  # fell silent during the agreement
                lost[rank] = "its heartbeat stopped while the survivors agreed on who goes on"
        iteration = max(agreement.iterations)  # a joined rank counts no more iterations
        try:
            group = self._build_group_watched(agreement.members, watch, watched, f"{prefix}build-failed")
        except _SurvivorsSilent as given_up:
            dropped = {rank: lost[rank] for rank in expected if rank not in agreement.members}
            given_up.lost = {**dropped, **given_up.lost}  # silent in the agreement, then in the build
            raise
        logger.warning(
            "Join: rank %d goes on without rank(s) %s from iteration %d, on a group of %d",
            me,
            sorted(set(lost) - set(self._lost)),
            iteration,
            len(agreement.members),
        )
        for rank in set(lost) - set(self._lost):
            lost[rank] = f"{lost[rank]}; removed at iteration {iteration}"
            # It took part in every heartbeat a survivor completed (one that finished the
            # interrupted iteration hands its result to the others).
            self._contributions[rank] = max(agreement.heartbeats)
        self._lost = lost
        self._group = group
        self._members = agreement.members
        self._rank = agreement.members.index(me)
        self._world_size = len(agreement.members)
        watch.stop()
        self._liveness = None
        if self._world_size > 1:
            self._liveness = self._start_watch(group)
        recovery = Recovery(
            group, self._rank, agreement.members, agreement.positions, self._period, iteration, dict(lost)
        )
        first = 0
        for hook in self._hooks:
            hook.regroup_hook(recovery, first)
            first += hook.regroup_phases
        return recovery

    def _build_group_watched(
        self, members: tuple[int, ...], watch: LivenessWatchdog, watched: dict[int, int], failed_key: str
    ) -> dist.ProcessGroup:
        """:func:`build_group`, given up when a member falls silent meanwhile (one that died
        after the agreement): ``new_group`` would wait for it the process group's timeout.
        A survivor that gives up says so under ``failed_key``: the others give up too, even
        one whose group was built a moment before (it would wait for this one in it).

        Raises:
            TimeoutError: a member's heartbeat stopped for the liveness timeout.
        """
        built: list[dist.ProcessGroup] = []
        failed: list[BaseException] = []

        def build() -> None:
            try:
                built.append(build_group(members, self._group))
            except BaseException as error:  # noqa: BLE001 - raised by the caller
                failed.append(error)

        # A daemon: left blocked in new_group when a member is gone, it must not hold the exit
        # (Join's exit grace ends the process without waiting for it).
        thread = threading.Thread(target=build, name="join-core-build-group", daemon=True)
        thread.start()
        assert self._liveness_timeout is not None  # a watch runs
        limit = self._liveness_timeout.total_seconds()
        me = self._members[self._rank]
        store = watch.store()
        while True:
            thread.join(_AGREEMENT_POLL_S)
            if store.check([failed_key]):
                raise _SurvivorsSilent.read(store.get(failed_key), members)
            if not thread.is_alive():
                break
            silent = [m for m in members if m != me and (watch.quiet_for(watched[m]) or 0.0) > limit]
            if silent:
                given_up = _SurvivorsSilent(
                    silent,
                    f"rank(s) {silent} fell silent while the survivors built their process group "
                    f"(no heartbeat for {limit:g} s)",
                )
                store.set(failed_key, given_up.encode())
                raise given_up
        if failed:
            raise failed[0]
        return built[0]

    def _start_watch(self, group: dist.ProcessGroup) -> LivenessWatchdog:
        assert self._liveness_timeout is not None
        watch = LivenessWatchdog(
            group,
            self._liveness_timeout,
            self._hang_timeout,
            judge_closed_connections=self._on_rank_lost == "continue",
        )
        watch.start()
        return watch

    # The rank's own side: joined or failing.

    def _raise_if_rank_lost(self, failure: BaseException) -> bool:
        """Raise the watch's verdict (RankLostError, CollectiveDesyncError)
        from ``failure`` if a collective failed because of it; otherwise return False.
        With ``on_rank_lost="continue"``, a loss that reaches here is one no joinable
        could go on from: the error says which could not."""
        verdict: BaseException | None = failure
        if not isinstance(failure, (RankLostError, CollectiveDesyncError)):
            if self._liveness is None or not _is_communication_failure(failure):
                return False
            verdict = self._liveness.wait_for_failure()
        stuck = _cannot_go_on(self._joinables, self._hooks)
        # (type, not isinstance: a removed rank's own RankRemovedError stays as it is)
        if type(verdict) is RankLostError and self._on_rank_lost == "continue":
            if stuck:
                raise RankLostError(verdict.ranks, detail=self._stuck_detail(stuck)) from failure
            if verdict is not failure:  # the survivors' recovery failed (their agreement, their group)
                ranks = dict(verdict.ranks)
                if isinstance(failure, _SurvivorsSilent):
                    me = self._members[self._rank]
                    for member, seen in failure.lost.items():
                        if member != me and member in self._members:
                            ranks.setdefault(self._members.index(member), seen)
                self._gave_up = RankLostError(
                    ranks,
                    detail=f"Join(on_rank_lost='continue') could not go on without it "
                    f"({_describe_failure(failure)}); destroy the process group and restart the job",
                )
                raise self._gave_up from failure
        if verdict is failure:
            return True  # already the verdict (a collective's wait raised it)
        if verdict is not None:
            raise verdict from failure
        return False

    @staticmethod
    def _stuck_detail(stuck: list[str]) -> str:
        return (
            f"Join(on_rank_lost='continue') cannot go on: {', '.join(stuck)} cannot do without a lost rank "
            "(FSDP2's shards have no copy elsewhere); restart from a checkpoint"
        )

    def _shadow_until_all_joined(self) -> None:
        is_last_joiner = True
        iterations = 0
        while True:
            if iterations == SKEW_WARN_THRESHOLD + 1:
                warnings.warn(
                    f"Detected uneven input skew of greater than {SKEW_WARN_THRESHOLD}. This means that "
                    f"rank {self._rank} has at least {SKEW_WARN_THRESHOLD} fewer inputs than other "
                    "currently-active ranks. This level of skew could lead to performance degradation "
                    "during training.",
                    stacklevel=3,
                )
            total = self._beat()
            if total < 0:
                self._agree_on_abort(None)
            if total == 0:
                break
            if self._throw_on_early_termination:
                self._done = True
                raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")
            for hook in self._hooks[1:] if self._fused else self._hooks:
                hook.main_hook()
            is_last_joiner = False
            iterations += 1
        for hook in self._hooks:
            hook.post_hook(is_last_joiner)

    def _beat(self, timeout: timedelta | None = None) -> float:
        """One heartbeat from a rank not training: the number of ranks training,
        or a negative number if a rank failed."""
        if not self._fused:
            self._last_total = self._all_reduce_signal(self._signal(), timeout)
            return self._last_total
        reported_before = self._reported
        self._hooks[0].main_hook()
        if self._reported == reported_before or self._last_total is None:
            raise RuntimeError(
                f"Join: the hook of {type(self._joinables[0]).__name__} carries the heartbeat but did "
                "not pass it to Join.heartbeat_result()"
            )
        return self._last_total

    def _abort(self, exc: BaseException) -> bool:
        """Tell the other ranks this one failed, within ABORT_TIMEOUT; whether they were told.

        The hooks' collectives run on a helper thread so that a peer that
        never answers cannot hold this rank: after the timeout it leaves with
        its own exception all the same."""
        self._state = _State.ABORTING
        finished = threading.Event()
        told: list[bool] = []

        def protocol() -> None:
            try:
                if self._device.type == "cuda":
                    torch.cuda.set_device(self._device)
                for hook in self._hooks:
                    hook.abort_hook()
                    if self._last_total is not None and self._last_total < 0:
                        break  # an interrupted iteration already carried the news
                else:
                    # The failing rank's signal outweighs every training rank's.
                    self._beat(ABORT_TIMEOUT)
                self._agree_on_abort(_describe_failure(exc))
                told.append(True)
            except Exception as failure:  # noqa: BLE001 - the original exception matters more
                logger.error("rank %d could not tell the other ranks that it failed: %s", self._rank, failure)
            finally:
                finished.set()

        threading.Thread(target=protocol, name="join-abort", daemon=True).start()
        if not finished.wait(ABORT_TIMEOUT.total_seconds()):
            logger.error(
                "rank %d: the other ranks did not take part in the abort within %.0f s; leaving anyway",
                self._rank,
                ABORT_TIMEOUT.total_seconds(),
            )
        return bool(told)

    def _agree_on_abort(self, reason: str | None) -> None:
        """Gather every failing rank's reason; raise JoinAbortedError on the
        others (a failing rank returns and lets its own exception go on)."""
        self._done = True
        mine = torch.zeros(_REASON_BYTES, dtype=torch.uint8, device=self._device)
        if reason is not None:
            encoded = reason.encode("utf-8", "replace")[:_REASON_BYTES]
            mine[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(self._world_size)]
        work = dist.all_gather(gathered, mine, group=self._group, async_op=True)
        _wait(work, ABORT_TIMEOUT, "the other ranks to exchange failure reasons")
        failures = {
            rank: bytes(buf.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
            for rank, buf in enumerate(gathered)
            if int(buf[0]) != 0
        }
        if reason is None:
            raise JoinAbortedError(failures)

    # Shared by both sides.

    def _signal(self) -> float:
        if self._state is _State.TRAINING:
            return _ACTIVE_SIGNAL
        if self._state is _State.JOINED:
            return _JOINED_SIGNAL
        return -float(self._world_size + 1)  # outweighs every training rank's 1

    def _all_reduce_signal(self, signal: float, timeout: timedelta | None) -> float:
        beat = torch.full((1,), signal, device=self._device)
        work = dist.all_reduce(beat, group=self._group, async_op=True)
        _wait(work, timeout, "the heartbeat all-reduce of the other ranks")
        return float(beat.item())

    def _on_total(self, total: float) -> bool:
        self._last_total = total
        self._reported += 1
        if self._state is not _State.TRAINING:
            return total != 0
        if total < 0:
            self._agree_on_abort(None)
        self._throw_if_a_rank_joined(total)
        return True

    def _throw_if_a_rank_joined(self, total: float) -> None:
        if not (self._throw_on_early_termination and 0 <= total < self._world_size):
            return
        self._done = True
        if self._state is _State.TRAINING:
            raise RuntimeError("Detected at least one rank that exhausted inputs. Throwing across all ranks.")
        raise RuntimeError(f"Rank {self._rank} exhausted all inputs.")

    @staticmethod
    def notify_join_context(joinable: Joinable) -> dist.Work | None:
        """Tell the Join this rank has not joined; call before each iteration's
        collectives.

        For the first joinable of an enabled Join this sends the heartbeat and
        returns its (completed) all-reduce work; for every other joinable, for
        one that carries the heartbeat in its own all-reduce, and outside an
        enabled Join it issues nothing and returns None.

        Raises:
            JoinAbortedError: another rank failed inside the Join.
            RuntimeError: with ``throw_on_early_termination``, a rank joined.
        """
        found = _lookup(joinable)
        if found is None:
            return None
        join, is_first = found
        if is_first:
            join._iterations += 1
        if not is_first or join._fused or join._state is not _State.TRAINING:
            return None
        beat = torch.ones(1, device=join._device)
        work: dist.Work = dist.all_reduce(beat, group=join._group, async_op=True)
        _wait(work, None, "the heartbeat all-reduce of the other ranks")
        join._on_total(float(beat.item()))
        return work

    @staticmethod
    def check_early_termination(joinable: Joinable, total: float) -> None:
        """With ``throw_on_early_termination``, raise the error every rank raises
        once the heartbeat's ``total`` shows that a rank joined; otherwise nothing.

        For a joinable that carries the heartbeat before its iteration's
        collectives (see :attr:`JoinHook.carries_heartbeat`): called right
        after that heartbeat on every rank (a joined one too, before it
        shadows anything), it has them all raise before those collectives.
        :meth:`heartbeat_result` raises the same on a training rank, later.

        Raises:
            RuntimeError: torch's early-termination errors: "Detected at least
                one rank that exhausted inputs" on a training rank, "Rank r
                exhausted all inputs" on a joined one.
        """
        found = _lookup(joinable)
        if found is not None and found[0]._state is not _State.ABORTING:
            found[0]._throw_if_a_rank_joined(total)

    @staticmethod
    def is_active(joinable: Joinable) -> bool:
        """Whether ``joinable`` is inside an entered, enabled Join right now."""
        return _lookup(joinable) is not None

    @staticmethod
    def heartbeats(joinable: Joinable) -> int:
        """How many heartbeats this rank has exchanged in the Join ``joinable``
        is in (0 outside one): a later joinable compares it with its own count
        of finished iterations to know whether it owes an iteration's
        collectives when :meth:`JoinHook.abort_hook` runs."""
        found = _lookup(joinable)
        return 0 if found is None else found[0]._reported

    @staticmethod
    def heartbeat_signal(joinable: Joinable) -> float:
        """The value this rank puts in the heartbeat slot it carries: 1 while
        training (also outside a Join), 0 once joined, negative when failing."""
        found = _lookup(joinable)
        return _ACTIVE_SIGNAL if found is None else found[0]._signal()

    @staticmethod
    def heartbeat_result(joinable: Joinable, total: float) -> bool:
        """Hand Join the reduced heartbeat slot carried by ``joinable``.

        Returns False when every rank has joined (a shadowing hook then issues
        nothing more this iteration), True otherwise.

        Raises:
            JoinAbortedError: on a training rank, when another rank failed.
            RuntimeError: on a training rank with ``throw_on_early_termination``,
                when a rank has joined.
        """
        found = _lookup(joinable)
        if found is None:
            return total != 0
        return found[0]._on_total(total)


def _is_communication_failure(error: BaseException) -> bool:
    # gloo reports a broken connection as a plain RuntimeError naming itself.
    return isinstance(error, (dist.DistError, ConnectionError, TimeoutError)) or (
        isinstance(error, RuntimeError) and "gloo" in str(error)
    )


def _wait(work: dist.Work, timeout: timedelta | None, what: str) -> None:
    if timeout is None:
        work.wait()
        return
    try:
        work.wait(timeout)
    except RuntimeError as error:
        raise TimeoutError(
            f"Join: timed out after {timeout.total_seconds():.0f} s waiting for {what}"
        ) from error


_SILENT_BUILDING: Final = "its heartbeat stopped while the survivors built their process group"


class _SurvivorsSilent(TimeoutError):
    """The survivors gave up building their group: ``members`` (global ranks) fell silent; with
    ``lost``, what was seen of each rank left out (``members`` too, once the caller adds them)."""

    def __init__(self, members: list[int], reason: str) -> None:
        super().__init__(reason)
        self.members = members
        self.lost: dict[int, str] = dict.fromkeys(members, _SILENT_BUILDING)

    def __reduce__(self) -> tuple[type[_SurvivorsSilent], tuple[list[int], str], dict[str, Any]]:
        return type(self), (self.members, str(self)), {"lost": self.lost}

    def encode(self) -> str:
        """As the others read it from the store: the ranks on the first line, then why."""
        return f"{','.join(map(str, self.members))}\n{self}"

    @classmethod
    def read(cls, value: bytes, members: tuple[int, ...]) -> _SurvivorsSilent:
        """What another survivor wrote (anyone can write to the store: only ranks among
        ``members`` are taken, and the reason is cut short)."""
        ranks, _, reason = value[:4096].decode("utf-8", "replace").partition("\n")
        silent = [
            int(rank)
            for rank in ranks.split(",")
            if rank.isdecimal() and len(rank) <= 9 and int(rank) in members
        ]
        return cls(silent, reason[:300])


def _group_of(joinable: Joinable) -> dist.ProcessGroup:
    group: dist.ProcessGroup | None = joinable.join_process_group
    return group if group is not None else _default_group()


def _default_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "Join: a joinable's join_process_group is None and the default process group is not "
            "initialized; call torch.distributed.init_process_group() first"
        )
    return group


def _check_on_rank_lost(
    on_rank_lost: str, liveness_timeout: timedelta | None, joinables: list[Joinable], hooks: list[JoinHook]
) -> str:
    if on_rank_lost not in _ON_RANK_LOST:
        raise ValueError(f"Join(on_rank_lost={on_rank_lost!r}): must be 'raise' or 'continue'")
    if on_rank_lost == "continue":
        if liveness_timeout is None:
            raise ValueError(
                "Join(on_rank_lost='continue', liveness_timeout=None): a lost rank is found by the "
                "liveness watch; give a liveness_timeout"
            )
        stuck = _cannot_go_on(joinables, hooks)
        if stuck:
            warnings.warn(
                f"Join(on_rank_lost='continue'): {', '.join(stuck)} cannot go on without a lost rank "
                "(its hook has no regroup_hook): a loss raises RankLostError as with on_rank_lost='raise'",
                RuntimeWarning,
                stacklevel=3,
            )
    return on_rank_lost


def _cannot_go_on(joinables: list[Joinable], hooks: list[JoinHook]) -> list[str]:
    """The names of the joinables whose hooks cannot move onto a survivors' group."""
    return [
        type(joinable).__name__
        for joinable, hook in zip(joinables, hooks)
        if type(hook).regroup_hook is JoinHook.regroup_hook
    ]


def _global_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    size = dist.get_world_size(group)
    if group is dist.group.WORLD:
        return tuple(range(size))
    return tuple(int(dist.get_global_rank(group, rank)) for rank in range(size))


def _lost_key(lost: set[int]) -> str:
    return "-".join(str(rank) for rank in sorted(lost))


def _describe_failure(exc: BaseException) -> str:
    """``"ValueError: message"``, as the other ranks are told of it."""
    name = "TimeoutError" if isinstance(exc, _SurvivorsSilent) else type(exc).__name__
    return f"{name}: {exc}" if str(exc) else name


def _raised_on_every_rank(exc: BaseException) -> bool:
    """Whether every rank raises ``exc`` too: an error that says so, as ShadowCollectives'
    ``CollectiveMismatchError`` does once its check found the mismatch."""
    return getattr(exc, "on_every_rank", False) is True
