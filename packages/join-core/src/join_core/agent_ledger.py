"""The agents' record of a job in its rendezvous store, shared across hosts.

Each agent of a job launched with :mod:`join_core.launch` keeps a
:class:`Ledger`: it numbers each of its workers' ends among the job's (so
"other workers still run" is judged across hosts, by
:func:`~join_core.job_outcome.judge_error`), publishes them, beats so that the
others know it is alive, counts the unfinished workers of an agent silent for
longer than the agent timeout as lost, and, once every worker ended, reads the
job's outcome and waits for the other agents to have read it too.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Final, cast

from torch.distributed.elastic.agent.server.api import WorkerGroup

from join_core.job_outcome import UNKNOWN_EXIT, JobOutcome, Verdict, WorkerEnd, judge_error

if TYPE_CHECKING:
    # The class of the rendezvous store; torch.distributed does not re-export it to type checkers.
    from torch._C._distributed_c10d import Store

# The survivor agent's bookkeeping: no public API.
__all__: list[str] = []

# Logged under the agent's name, as before the ledger had a module of its own.
logger: logging.Logger = logging.getLogger("join_core.survivor_agent")

#: Seconds between an agent's beats.
BEAT_INTERVAL: Final = 1.0
#: Seconds the agents wait, once every worker ended, for every live agent to
#: have read the outcome before they leave (one of them may serve the store).
READ_WAIT: Final = 30.0

#: Seconds torch's exit barrier waits for a lost agent once the others succeeded.
EXIT_BARRIER_TIMEOUT: Final = 5.0

_PREFIX: Final = "join_core/launch/"
_ENDS: Final = f"{_PREFIX}ends"  # numbers each worker's end, in the order seen
_SUCCEEDED: Final = f"{_PREFIX}succeeded"  # workers that ended with exit code 0
_RECORDED: Final = f"{_PREFIX}recorded"  # ends whose record is in the store
_READ: Final = f"{_PREFIX}read"  # agents that read the outcome


class Ledger:
    """This agent's side of the job's record in the rendezvous store: each
    worker's end, the agents' beats, and the final outcome."""

    def __init__(self, worker_group: WorkerGroup, agent_timeout: float) -> None:
        # WorkerGroup's attributes are typed by their initial None.
        store = cast("Store | None", worker_group.store)
        if store is None:
            raise RuntimeError("join_core.launch: the agent has no rendezvous store (no rendezvous yet)")
        self._store: Store = store
        self._group_rank = int(cast("int | None", worker_group.group_rank) or 0)
        self._agents = int(cast("int | None", worker_group.group_world_size) or 1)
        self._world_size = int(worker_group.workers[0].world_size)
        self._host = socket.gethostname()
        self._timeout = agent_timeout
        self._beat_at = -float("inf")
        self._judged_at = -float("inf")
        self._seen: dict[int, tuple[int, float]] = {}  # agent -> (its beat, when it last moved)
        self._lost_agents: set[int] = set()
        self._unclaimed_owed = False  # a lost agent had not said which ranks it runs
        ranks = [worker.global_rank for worker in worker_group.workers]
        self._store.set(self._ranks_key(self._group_rank), json.dumps(ranks))

    @staticmethod
    def _ranks_key(agent: int) -> str:
        return f"{_PREFIX}agent/{agent}/ranks"

    @staticmethod
    def _beat_key(agent: int) -> str:
        return f"{_PREFIX}agent/{agent}/beat"

    @staticmethod
    def _end_key(rank: int) -> str:
        return f"{_PREFIX}end/{rank}"

    def beat(self, now: float) -> None:
        """Tell the other agents this one is alive (at most once a BEAT_INTERVAL)."""
        if now - self._beat_at >= BEAT_INTERVAL:
            self._beat_at = now
            self._store.add(self._beat_key(self._group_rank), 1)

    def record(self, rank: int, local_rank: int, pid: int, exitcode: int, message: str) -> WorkerEnd:
        """Number a local worker's end among the job's, judge it, and publish it."""
        verdict: Verdict
        if exitcode == 0:
            self._store.add(_SUCCEEDED, 1)  # before its number: a failure numbered after it sees it
            self._store.add(_ENDS, 1)
            verdict, detail = "succeeded", ""
        else:
            running = self._world_size - int(self._store.add(_ENDS, 1))
            finished = int(self._store.add(_SUCCEEDED, 0))
            verdict, detail = judge_error(exitcode, message, running, finished)
        end = WorkerEnd(rank, local_rank, self._host, pid, exitcode, verdict, detail)
        self._publish(end)
        return end

    def _publish(self, end: WorkerEnd) -> bool:
        """Write ``end`` unless the rank already has a record; count it if written."""
        raw = end.to_json()
        current = self._store.compare_set(self._end_key(end.rank), "", raw)
        if current != raw.encode():
            return False
        self._store.add(_RECORDED, 1)
        return True

    def job_outcome(self, now: float) -> JobOutcome | None:
        """Every worker's end once all are recorded; None while some still run.
        Judges silent agents on the way (once a BEAT_INTERVAL)."""
        if int(self._store.add(_RECORDED, 0)) < self._world_size:
            if now - self._judged_at < BEAT_INTERVAL:
                return None
            self._judged_at = now
            self._judge_silent_agents(now)
            if int(self._store.add(_RECORDED, 0)) < self._world_size:
                return None
        raws = self._store.multi_get([self._end_key(rank) for rank in range(self._world_size)])
        ends = []
        for rank, raw in enumerate(raws):
            try:
                ends.append(WorkerEnd.from_json(raw))
            except (ValueError, KeyError, TypeError) as error:
                ends.append(
                    WorkerEnd(rank, -1, "?", -1, UNKNOWN_EXIT, "failed", f"unreadable record: {error}")
                )
        return JobOutcome(tuple(ends))

    def _judge_silent_agents(self, now: float) -> None:
        silent = []
        for agent in range(self._agents):
            if agent == self._group_rank or agent in self._lost_agents:
                continue
            beat = int(self._store.add(self._beat_key(agent), 0))
            last = self._seen.get(agent)
            if last is None or last[0] != beat:
                self._seen[agent] = (beat, now)
            elif now - last[1] > self._timeout:
                silent.append(agent)
        for agent in silent:
            self._lost_agents.add(agent)
            ranks = self._agent_ranks(agent)
            quiet = now - self._seen[agent][1]
            logger.warning(
                "join_core.launch: the agent of group rank %d has not answered for %.0f s: its unfinished "
                "workers (ranks %s) count as lost (torch's exit barrier then waits %.0f s for it in vain)",
                agent,
                quiet,
                ", ".join(map(str, ranks)) or "unknown: those no agent claims",
                EXIT_BARRIER_TIMEOUT,
            )
            if not ranks:
                self._unclaimed_owed = True  # it went down before it wrote them
            reason = f"its agent stopped answering for {quiet:.0f} s (its host went down?)"
            self._publish_lost(ranks, f"the host of agent {agent}", reason)
        if self._unclaimed_owed:
            unclaimed = self._unclaimed_ranks()
            if unclaimed is not None:
                self._unclaimed_owed = False
                reason = (
                    "its agent stopped answering before it said which ranks it runs (its host went down?)"
                )
                self._publish_lost(unclaimed, "the host of a lost agent", reason)

    def _publish_lost(self, ranks: list[int], host: str, reason: str) -> None:
        for rank in ranks:
            if not self._store.check([self._end_key(rank)]):
                self._publish(
                    WorkerEnd(rank, -1, host, -1, UNKNOWN_EXIT, "lost", reason)
                )  # local rank unknown

    def _unclaimed_ranks(self) -> list[int] | None:
        """The job's ranks that no agent's record claims, once every agent without a record is
        lost (they are the ranks of those agents); None while an agent without one may still write it."""
        claimed: set[int] = set()
        for agent in range(self._agents):
            if not self._store.check([self._ranks_key(agent)]):
                if agent not in self._lost_agents:
                    return None
                continue
            claimed.update(self._agent_ranks(agent))
        return [rank for rank in range(self._world_size) if rank not in claimed]

    def _agent_ranks(self, agent: int) -> list[int]:
        key = self._ranks_key(agent)
        if not self._store.check([key]):
            return []
        with suppress(ValueError, TypeError):
            return [int(rank) for rank in json.loads(self._store.get(key))][: self._world_size]
        return []

    def wait_for_readers(self) -> None:
        """Count this agent as having read the outcome, and wait (at most
        READ_WAIT) for every live agent to have: one may serve the store."""
        readers = int(self._store.add(_READ, 1))
        deadline = time.monotonic() + READ_WAIT
        expected = self._agents - len(self._lost_agents)
        while readers < expected and time.monotonic() < deadline:
            time.sleep(BEAT_INTERVAL / 10)
            readers = int(self._store.add(_READ, 0))
        if readers < expected:
            logger.warning(
                "join_core.launch: %d of %d agents read the outcome within %.0f s; leaving anyway",
                readers,
                expected,
                READ_WAIT,
            )
