"""A torch.distributed.elastic agent whose workers outlive one another.

torch's ``LocalElasticAgent`` treats its workers as one unit: when one ends
with an error it stops the others, then restarts or fails the whole group.
:class:`SurvivorAgent` is that agent with another policy, for jobs whose
ranks go on without a lost one (``Join(on_rank_lost="continue")``):

- A worker that ends with an error (an exit code or a signal) while other
  workers of the job still run is **lost**: the agent logs it, and the
  others keep running. Nothing is restarted, and no node waiting to join is
  admitted while workers run.
- A worker that ends with an error after a worker of the job finished
  successfully, or as the last one running, **failed**. (A rank the
  survivors removed after a freeze, which raises ``RankRemovedError`` when
  it wakes, should then exit with 0 if that comes after they finished.)
- The job **succeeds** (every agent exits with 0) when at least one worker
  succeeded and none failed; each agent then logs one summary of every rank.

Agents of a job on several hosts agree on this through their rendezvous
store: each worker's end is numbered there (so "other workers still run" is
judged across hosts), and an agent whose workers all ended waits for the
others' before it leaves, as the rendezvous store and the workers' store
may be in its process. An agent that stops beating in the store for
``agent_timeout`` (its host went down) has its unfinished workers counted as
lost. The workers use the agent's store (``TORCHELASTIC_USE_AGENT_STORE``),
so losing any worker, rank 0's included, loses no store.

Use it through ``python -m join_core.launch`` (:mod:`join_core.launch`).
The verdicts are :mod:`join_core.job_outcome`'s, the agents' record in the
store :mod:`join_core.agent_ledger`'s, and the rendezvous handler that
admits no node :mod:`join_core.survivor_rendezvous`'s.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Final

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs, ProcessFailure

from join_core._torch_elastic import worker_error_file, worker_processes
from join_core.agent_ledger import BEAT_INTERVAL, EXIT_BARRIER_TIMEOUT, Ledger
from join_core.job_outcome import JobOutcome, WorkerEnd
from join_core.survivor_rendezvous import SurvivorRendezvous

__all__ = ["DEFAULT_AGENT_TIMEOUT", "JobOutcome", "SurvivorAgent", "SurvivorRendezvous", "WorkerEnd"]

logger: logging.Logger = logging.getLogger(__name__)

#: Seconds an agent may go without beating in the rendezvous store before the
#: others count its unfinished workers as lost.
DEFAULT_AGENT_TIMEOUT: Final = 30.0


class SurvivorAgent(LocalElasticAgent):
    """``LocalElasticAgent`` whose workers go on when one of them is lost
    (see the module's docstring for the policy).

    Args:
        spec: the workers, as for ``LocalElasticAgent``; ``max_restarts``
            must be 0 (the survivors go on instead of the group restarting).
        logs_specs: where the workers' output goes.
        start_method: as for ``LocalElasticAgent`` (scripts and binaries only).
        log_line_prefix_template: as for ``LocalElasticAgent``.
        agent_timeout: seconds another agent of the job may stay silent in
            the rendezvous store before its unfinished workers count as lost.
        kwargs: passed to ``LocalElasticAgent`` (e.g. ``shutdown_timeout``).

    After :meth:`run`, :attr:`outcome` tells how every worker of the job ended.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        start_method: str = "spawn",
        log_line_prefix_template: str | None = None,
        agent_timeout: float = DEFAULT_AGENT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        if spec.max_restarts != 0:
            raise ValueError(
                f"SurvivorAgent(spec.max_restarts={spec.max_restarts}): must be 0: the surviving workers go "
                "on instead of the group restarting"
            )
        if agent_timeout < 3 * BEAT_INTERVAL:
            raise ValueError(
                f"SurvivorAgent(agent_timeout={agent_timeout}): must be at least {3 * BEAT_INTERVAL:g} s "
                f"(agents beat every {BEAT_INTERVAL:g} s)"
            )
        super().__init__(
            spec,
            logs_specs,
            start_method,
            # torch's barrier after success: by then the live agents have met in wait_for_readers,
            # so only a lost agent is waited for, in vain.
            exit_barrier_timeout=EXIT_BARRIER_TIMEOUT,
            log_line_prefix_template=log_line_prefix_template,
            **kwargs,
        )
        self._agent_timeout = agent_timeout
        self._ledger: Ledger | None = None
        self._ended: dict[int, WorkerEnd] = {}  # local rank -> its end
        self._failures: dict[int, ProcessFailure] = {}  # global rank -> torch's record of its error
        self.outcome: JobOutcome | None = None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        processes = worker_processes(self)
        ledger = self._ledger
        if ledger is None:
            ledger = self._ledger = Ledger(worker_group, self._agent_timeout)
        now = time.monotonic()
        ledger.beat(now)
        for local_rank, proc in processes.items():
            exitcode = proc.poll() if local_rank not in self._ended else None
            if exitcode is not None:
                self._record_end(worker_group, ledger, local_rank, proc.pid, exitcode)
        if len(self._ended) < len(processes):
            return RunResult(state=WorkerState.HEALTHY)
        outcome = ledger.job_outcome(now)
        if outcome is None:
            return RunResult(state=WorkerState.HEALTHY)  # other workers of the job still run
        self.outcome = outcome
        level = logging.ERROR if not outcome.succeeded else logging.WARNING if outcome.lost else logging.INFO
        logger.log(level, "join_core.launch: %s", outcome.summary())
        ledger.wait_for_readers()
        mine = {end.rank: end for end in self._ended.values()}
        failures = {rank: self._failures[rank] for rank, end in mine.items() if end.verdict != "succeeded"}
        if outcome.succeeded:
            succeeded = {rank: None for rank, end in mine.items() if end.verdict == "succeeded"}
            return RunResult(state=WorkerState.SUCCEEDED, return_values=succeeded, failures=failures)
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _record_end(
        self, worker_group: WorkerGroup, ledger: Ledger, local_rank: int, pid: int, exitcode: int
    ) -> None:
        worker = worker_group.workers[local_rank]
        message = ""
        if exitcode != 0:
            failure = _failure(local_rank, pid, exitcode, worker_error_file(self, local_rank))
            self._failures[worker.global_rank] = failure
            message = _last_line(failure)
        end = ledger.record(worker.global_rank, local_rank, pid, exitcode, message)
        self._ended[local_rank] = end
        if end.verdict == "lost":
            logger.warning("join_core.launch: worker %s; the agent keeps the others running", end.describe())
        elif end.verdict == "failed":
            logger.error("join_core.launch: worker %s", end.describe())
        else:
            logger.info("join_core.launch: worker %s", end.describe())


def _last_line(failure: ProcessFailure) -> str:
    """The last line of the error a worker recorded (torch's ``@record``: its exception), or ""."""
    if not os.path.isfile(failure.error_file):
        return ""
    raw: object = failure.message
    if isinstance(raw, dict):  # torch's own error files nest it
        raw = raw.get("message", "")
    lines = str(raw).strip().splitlines()
    return lines[-1][:300] if lines else ""


def _failure(local_rank: int, pid: int, exitcode: int, error_file: str) -> ProcessFailure:
    try:
        return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file=error_file)
    except Exception:  # noqa: BLE001 - an unreadable error file: report the exit alone
        return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file="")
